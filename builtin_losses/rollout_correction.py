"""The built-in rollout corrections: truncated importance sampling (TIS) between the policy
that the loss treats as "old" and the sampler that really generated the tokens.

ρ = exp((old - sampling) · m) per token, or exp(Σ_t (old - sampling) · m) per sequence. The
``truncate`` variants clamp ρ into [clip_min, cap]; the ``mask`` variants set ρ to 0 where it
is above the cap or below clip_min (the token or sequence is dropped). ``clip_min`` is a param
(None: no lower bound; TRL's ``vllm_importance_sampling_clip_min``). A sampler log-prob that is
NaN counts as no mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.kinds import RolloutCorrection

if TYPE_CHECKING:
    from torch import Tensor


def _log_ratio(old: Tensor, sampling: Tensor, mask: Tensor, per_sequence: bool) -> Tensor:
    diff = ((old - sampling) * mask).nan_to_num(nan=0.0)  # (B, T)
    return diff.sum(-1, keepdim=True) if per_sequence else diff  # (B, 1) or (B, T)


class BoundsParams(BaseModel):
    """The lower bound; the upper one is ``vllm_importance_sampling_cap``."""

    model_config = ConfigDict(extra="forbid")
    clip_min: float | None = Field(
        None, ge=0, description="Lower bound C_min of the ratio (truncate: clamp up to it; mask: drop below it); None: none."
    )


class _Bounded(RolloutCorrection):
    per_sequence = False
    Params = BoundsParams

    def __init__(self, params: BoundsParams | None = None) -> None:
        self.params = params or BoundsParams()


class _Truncate(_Bounded):
    def weights(self, old_per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor, cap: float) -> Tensor:
        log_ratio = _log_ratio(old_per_token_logps, sampling_per_token_logps, mask, self.per_sequence)
        return log_ratio.exp().clamp(min=self.params.clip_min, max=cap)


class _Mask(_Bounded):
    def weights(self, old_per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor, cap: float) -> Tensor:
        ratio = _log_ratio(old_per_token_logps, sampling_per_token_logps, mask, self.per_sequence).exp()
        low = self.params.clip_min if self.params.clip_min is not None else float("-inf")
        return ratio.masked_fill((ratio > cap) | (ratio < low), 0.0)


class TokenTruncate(_Truncate):
    """Per-token ratio truncated at the cap: min(ρ_t, C), and at clip_min from below (the default)."""


class TokenMask(_Mask):
    """Per-token ratio, 0 for tokens whose ratio exceeds the cap (or falls below clip_min)."""


class SequenceTruncate(_Truncate):
    """Per-sequence ratio (product over its tokens) truncated at the cap."""

    per_sequence = True


class SequenceMask(_Mask):
    """Per-sequence ratio, 0 for sequences whose ratio exceeds the cap (or falls below clip_min)."""

    per_sequence = True
