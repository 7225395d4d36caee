"""The built-in group filters (DAPO's dynamic sampling): keep every group, drop the groups whose
rewards are all equal, or keep the groups whose accuracy lies in a band."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo_plugins.kinds import GroupFilter

if TYPE_CHECKING:
    from torch import Tensor


class KeepAll(GroupFilter):
    """Train on every group as generated (the default; no dynamic sampling)."""

    drops_groups: ClassVar[bool] = False

    def keep(self, rewards: Tensor, total: Tensor, names: list[str], num_generations: int) -> Tensor:
        import torch

        return torch.ones(total.shape[0] // num_generations, dtype=torch.bool, device=total.device)


class DropZeroStd(GroupFilter):
    """Drop groups whose weighted rewards have zero spread (all equal: zero advantage, no signal;
    DAPO's filter). A group counts as zero-std exactly as ``frac_reward_zero_std`` counts it
    (its NaN-aware std within 1e-8 of 0; a group with fewer than two scorable rows has std 0)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        min_std: float = Field(0.0, ge=0, description="Also drop groups whose reward std is at most this.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def keep(self, rewards: Tensor, total: Tensor, names: list[str], num_generations: int) -> Tensor:
        import torch

        from grpo_plugins.advantages import nan_std

        std = nan_std(total.reshape(-1, num_generations), dim=1)  # (N/G,)
        zero = torch.isclose(std, torch.zeros((), dtype=std.dtype, device=std.device))
        return ~zero & (std > self.params.min_std)


class AccuracyBand(GroupFilter):
    """Keep groups whose mean reward lies in a band: by default strictly between 0 and 1 (drop
    groups that are all wrong or all right, DAPO's accuracy filter); with ``inclusive: true``
    the closed band [low, high]. The mean is over the group's scorable rows of the named reward
    (a 0/1 correctness reward), or of the weighted total when ``reward`` is not set; a group
    with no scorable row is dropped."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        reward: str | None = Field(None, description="The reward whose group mean is the accuracy; None: the weighted total.")
        low: float = Field(0.0, description="Lower edge of the band.")
        high: float = Field(1.0, description="Upper edge of the band.")
        inclusive: bool = Field(False, description="Keep means equal to low or high too ([low, high] instead of (low, high)).")

        @model_validator(mode="after")
        def _ordered(self) -> AccuracyBand.Params:
            if self.low > self.high:
                raise ValueError(f"low ({self.low}) must not be above high ({self.high})")
            return self

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def check_rewards(self, names: list[str]) -> None:
        if self.params.reward is not None and self.params.reward not in names:
            raise ValueError(
                f"group_filter accuracy_band: reward '{self.params.reward}' is not a reward of this run "
                f"({', '.join(names)}); set group_filter.params.reward to one of them"
            )

    def keep(self, rewards: Tensor, total: Tensor, names: list[str], num_generations: int) -> Tensor:
        import torch

        p = self.params
        self.check_rewards(names)
        values = total if p.reward is None else rewards[:, names.index(p.reward)]
        groups = values.reshape(-1, num_generations)  # (N/G, G)
        valid = ~torch.isnan(groups)
        count = valid.sum(1)
        mean = torch.where(valid, groups, 0.0).sum(1) / count.clamp(min=1)  # (N/G,)
        inside = (mean >= p.low) & (mean <= p.high) if p.inclusive else (mean > p.low) & (mean < p.high)
        return inside & (count > 0)
