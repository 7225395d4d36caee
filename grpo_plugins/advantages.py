"""From per-reward scores to one advantage per completion (docs/objective.md).

Rows are completions, columns are reward functions; NaN means "reward not applicable" (a reward
returned None). Groups are ``num_generations`` consecutive rows. The reward scaling (group,
batch, none, or a plugin's) is a ``reward_scaling`` component found in the registry by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import Registry

#: std's additive guard, as in TRL: A = (R - mean) / (std + STD_EPS).
STD_EPS = 1e-4


class AdvantageError(GRPOPluginsError, ValueError):
    """Rewards, weights or group size that do not fit together."""


def nan_std(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """NaN-aware sample standard deviation (Bessel's correction) over ``dim`` (all if None).

    Where fewer than two values are not NaN the result is 0 (one sample has no spread), never
    NaN.
    """
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    valid = ~torch.isnan(x)
    count = valid.sum(dim=dims, keepdim=True)
    mean = torch.where(valid, x, 0.0).sum(dim=dims, keepdim=True) / count.clamp(min=1)
    squares = torch.where(valid, (x - mean) ** 2, 0.0).sum(dim=dims, keepdim=True)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    std = torch.where(count > 1, std, 0.0)
    return std if keepdim else std.squeeze(dims) if dims else std


def group_view(rewards: Tensor, num_generations: int) -> Tensor:
    """(N,) -> (N / G, G), one row per group."""
    return rewards.view(-1, num_generations)


def group_mean(rewards: Tensor, num_generations: int) -> Tensor:
    """(N,) NaN-aware mean of each row's group, repeated per row (NaN for an all-NaN group)."""
    return torch.nanmean(group_view(rewards, num_generations), dim=1).repeat_interleave(num_generations)


def group_std(rewards: Tensor, num_generations: int) -> Tensor:
    """(N,) NaN-aware sample std of each row's group, repeated per row."""
    return nan_std(group_view(rewards, num_generations), dim=1).repeat_interleave(num_generations)


def combine_rewards(rewards_per_func: Tensor, reward_weights: Sequence[float] | Tensor | None = None) -> Tensor:
    """(N, K) -> (N,) weighted sum skipping NaN; NaN for rows where every reward is NaN."""
    rewards_per_func = _as_2d(rewards_per_func)
    weights = _weights(reward_weights, rewards_per_func)
    combined = (rewards_per_func * weights).nansum(dim=1)  # (N,)
    return combined.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def _as_2d(rewards_per_func: Tensor) -> Tensor:
    if not torch.is_floating_point(rewards_per_func):
        rewards_per_func = rewards_per_func.float()
    if rewards_per_func.dim() == 1:
        rewards_per_func = rewards_per_func.unsqueeze(1)
    if rewards_per_func.dim() != 2:
        raise AdvantageError(f"rewards_per_func must be (N, K); got shape {tuple(rewards_per_func.shape)}")
    return rewards_per_func


def _weights(reward_weights: Sequence[float] | Tensor | None, rewards_per_func: Tensor) -> Tensor:
    k = rewards_per_func.shape[1]
    if reward_weights is None:
        return torch.ones(k, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    weights = torch.as_tensor(reward_weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if weights.shape != (k,):
        raise AdvantageError(
            f"reward_weights has {weights.numel()} entries but there are {k} rewards; give one weight per reward"
        )
    return weights


def _sum_then_normalize(rewards_per_func: Tensor, weights: Tensor, num_generations: int, scaling: Any) -> Tensor:
    rewards = combine_rewards(rewards_per_func, weights)  # (N,) NaN = unscorable
    return scaling.advantages(rewards, num_generations)


def _normalize_then_sum(rewards_per_func: Tensor, weights: Tensor, num_generations: int, scaling: Any) -> Tensor:
    """GDPO: standardise each reward within its group, weighted sum, standardise over the batch.
    (As in TRL, ``scale_rewards`` does not enter here.)"""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])  # (N/G, G, K)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)  # (N/G, 1, K)
    std_k = nan_std(grouped, dim=1, keepdim=True)  # (N/G, 1, K)
    per_reward = ((grouped - mean_k) / (std_k + STD_EPS)).view_as(rewards_per_func)  # (N, K)
    rewards = (per_reward * weights).nansum(dim=1)  # (N,)
    rewards = rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))
    return (rewards - torch.nanmean(rewards)) / (nan_std(rewards) + STD_EPS)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int, Any], Tensor]] = {
    "sum_then_normalize": _sum_then_normalize,
    "normalize_then_sum": _normalize_then_sum,
}


def compute_advantages(
    rewards_per_func: Tensor,
    *,
    num_generations: int,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: str | Any = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    registry: Registry | None = None,
) -> Tensor:
    """One advantage per completion from the scores of every reward (docs/objective.md).

    Args:
        rewards_per_func: (N, K) scores, NaN where a reward returned None; groups are
            ``num_generations`` consecutive rows (all processes' rows, gathered).
        num_generations: G, completions per prompt.
        reward_weights: K weights (default all 1.0).
        scale_rewards: a ``reward_scaling`` component: "group", "batch", "none", a plugin's
            name, ``{name, params}``, or a built component. (The config's true / false are
            read as "group" / "none" when the config loads.)
        multi_objective_aggregation: "sum_then_normalize" (weighted nansum, then the scaling)
            or "normalize_then_sum" (GDPO).
        registry: where to find the scaling (default: the process-wide registry).

    Returns:
        (N,) advantages; 0 for unscorable rows (every reward NaN). The built-in scalings never
        give NaN for a scorable row; a NaN or inf from a plugin scaling (or an inf reward) is
        returned as it is, not hidden, so that the engine's guard can name the component.
    """
    from grpo_plugins.registry import resolve_component

    rewards_per_func = _as_2d(rewards_per_func)
    n = rewards_per_func.shape[0]
    if num_generations < 1 or n % num_generations:
        raise AdvantageError(
            f"{n} completions do not form whole groups of num_generations={num_generations}; "
            "the batch must hold a whole number of groups"
        )
    if multi_objective_aggregation not in AGGREGATIONS:
        raise AdvantageError(
            f"unknown multi_objective_aggregation '{multi_objective_aggregation}'; "
            f"use one of {', '.join(AGGREGATIONS)}"
        )
    if isinstance(scale_rewards, bool):  # not a component: the config's spelling, which it resolves itself
        raise AdvantageError(
            f"scale_rewards takes a reward_scaling component such as 'group', 'batch' or 'none', not {scale_rewards}"
            " (a config's true / false mean 'group' / 'none')"
        )
    scaling = resolve_component("reward_scaling", scale_rewards, registry)
    weights = _weights(reward_weights, rewards_per_func)
    aggregate = AGGREGATIONS[multi_objective_aggregation]
    advantages = aggregate(rewards_per_func, weights, num_generations, scaling)  # (N,)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (N,)
    return advantages.masked_fill(unscorable, 0.0)
