"""The built-in reward scalings. Each centres a reward on its group's NaN-aware mean; they
differ in the spread it is divided by: the group's std, the batch's std, or nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_plugins.kinds import RewardScaling

if TYPE_CHECKING:
    from torch import Tensor


class GroupScaling(RewardScaling):
    """A = (R - mean_group) / (std_group + 1e-4) (GRPO; ``scale_rewards: group`` or true)."""

    def advantages(self, rewards: Tensor, num_generations: int) -> Tensor:
        from grpo_plugins.advantages import STD_EPS, group_mean, group_std

        centred = rewards - group_mean(rewards, num_generations)
        return centred / (group_std(rewards, num_generations) + STD_EPS)


class BatchScaling(RewardScaling):
    """A = (R - mean_group) / (std_batch + 1e-4) (``scale_rewards: batch``)."""

    def advantages(self, rewards: Tensor, num_generations: int) -> Tensor:
        from grpo_plugins.advantages import STD_EPS, group_mean, nan_std

        return (rewards - group_mean(rewards, num_generations)) / (nan_std(rewards) + STD_EPS)


class NoScaling(RewardScaling):
    """A = R - mean_group (Dr. GRPO; ``scale_rewards: none`` or false)."""

    def advantages(self, rewards: Tensor, num_generations: int) -> Tensor:
        from grpo_plugins.advantages import group_mean

        return rewards - group_mean(rewards, num_generations)
