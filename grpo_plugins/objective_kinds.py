"""The interfaces of the objective's component kinds: a loss type (with the inputs it reads),
an importance sampling level, a reward scaling and a rollout correction; used by
:func:`grpo_plugins.objective.compute_loss` (docs/objective.md). Plugin authors import them from
:mod:`grpo_plugins.kinds`, which names every kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel

if TYPE_CHECKING:  # torch is imported lazily: `list` and `validate` must start in well under 1 s.
    from torch import Tensor


@dataclass
class LossInputs:
    """Everything a loss type may read for one micro-batch. Shapes: B rows, T completion tokens.

    Log-probabilities are zero at masked positions (so padding can never put a NaN or inf into
    the loss or its gradient); ``log_ratio`` is ``per_token_logps - old_per_token_logps`` there.
    ``log_weights`` is what the importance-sampling level returned: (B, T) at token level, (B, 1)
    at sequence level, and ``ratio = exp(log_weights)``. ``advantages`` is (B, 1) (or (B, T)
    when the caller gives per-token advantages). ``mask`` is the float completion mask after
    truncation masking.
    """

    per_token_logps: Tensor  # (B, T) current policy, carries the gradient
    old_per_token_logps: Tensor  # (B, T) detached
    advantages: Tensor  # (B, 1)
    mask: Tensor  # (B, T) float
    log_ratio: Tensor  # (B, T)
    log_weights: Tensor  # (B, T) or (B, 1)
    ratio: Tensor  # (B, T) or (B, 1)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    max_completion_length: int | None = None
    #: Active tokens of the optimizer step's whole accumulation window over all processes, a
    #: 0-d tensor on the loss's device, or None when the caller does not know it.
    num_items_in_batch: Tensor | None = None
    num_processes: int = 1
    gradient_accumulation_steps: int = 1
    #: The rollout correction's weights ρ, (B, T) or (B, 1), detached, when the correction is on,
    #: else None. The core multiplies them into the policy term unless the loss type says it
    #: applies them itself (``applies_rollout_correction``).
    rollout_weights: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def clipped_surrogate(inputs: LossInputs) -> Tensor:
    """GRPO/PPO's clipped surrogate ``-min(r·A, clamp(r, 1-ε, 1+ε_high)·A)``, with the unclipped
    ratio capped at δ when ``delta`` is set (two-sided GRPO). (B, T) or (B, 1)."""
    import torch

    ratio = inputs.ratio
    clipped = ratio.clamp(1 - inputs.epsilon_low, 1 + inputs.epsilon_high)
    if inputs.delta is not None:
        ratio = ratio.clamp(max=inputs.delta)
    return -torch.min(ratio * inputs.advantages, clipped * inputs.advantages)


@dataclass(frozen=True)
class RowExtremum:
    """A metric that is the smallest (``reduce="min"``) or largest (``"max"``) row value of the
    logged step, over every micro-batch and process.

    ``values`` is (B, T) or (B, 1), like a mean-type metric's. A row's value is the mean of its
    (B, T) values over its active tokens (a row without one has no value and is left out), or
    its (B, 1) value as it is (every row counts). TRL's ``clip_ratio/low_min`` and
    ``clip_ratio/high_max`` are of this type.
    """

    values: Tensor  # (B, T) or (B, 1)
    reduce: Literal["min", "max"]


def clip_indicators(inputs: LossInputs) -> dict[str, Tensor | RowExtremum]:
    """TRL's clip ratios as 0/1 values per token (or sequence): low = r < 1-ε with A < 0,
    high = r > 1+ε_high with A > 0, region = either; and ``clip_ratio/low_min`` /
    ``clip_ratio/high_max``, the smallest row fraction of low-clipped and the largest of
    high-clipped values."""
    ratio = inputs.ratio if inputs.delta is None else inputs.ratio.clamp(max=inputs.delta)
    low = (ratio < 1 - inputs.epsilon_low) & (inputs.advantages < 0)
    high = (ratio > 1 + inputs.epsilon_high) & (inputs.advantages > 0)
    return {
        "clip_ratio/low_mean": low.float(),
        "clip_ratio/high_mean": high.float(),
        "clip_ratio/region_mean": (low | high).float(),
        "clip_ratio/low_min": RowExtremum(low.float(), "min"),
        "clip_ratio/high_max": RowExtremum(high.float(), "max"),
    }


class LossType:
    """How the per-token policy loss is formed and reduced to a scalar (kind ``loss_type``).

    * ``per_token_loss`` returns the policy term, (B, T) or (B, 1), *before* the rollout
      correction and the KL term are applied; the default is GRPO's clipped surrogate
      (:func:`clipped_surrogate`).
    * ``reduce`` turns the final per-token loss, always (B, T), into the micro-batch's scalar
      loss, including any division by ``gradient_accumulation_steps``. Multiply by
      ``inputs.mask`` and clamp every denominator (``.clamp(min=1.0)``): an all-masked batch
      must give exactly 0.
    * ``metrics`` returns per-token (B, T) or per-sequence (B, 1) values, each averaged over the
      logged step's active tokens, or over all its sequences for (B, 1) values (TRL's
      definition: a sequence without an active token counts with its value), or a
      :class:`RowExtremum` for a min / max over rows; the default gives TRL's clip ratios.

    A loss type that only changes normalisation overrides ``reduce`` alone. One that folds the
    rollout correction into its own surrogate (VESPO) sets ``applies_rollout_correction = True``
    and reads ``inputs.rollout_weights``; the core then does not multiply them in.
    """

    Params: ClassVar[type[BaseModel] | None] = None
    applies_rollout_correction: ClassVar[bool] = False

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        return clipped_surrogate(inputs)

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        raise NotImplementedError

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor | RowExtremum]:
        return clip_indicators(inputs)


@runtime_checkable
class ImportanceSampling(Protocol):
    """Turns per-token log-ratios into log importance weights (kind ``importance_sampling``).

    Subclass it (or just provide the method); a class attribute ``Params`` adds parameters.
    """

    def log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        """(B, T) log-ratios (0 at masked positions) and float mask -> (B, T) or (B, 1) log
        importance weights."""
        ...


@runtime_checkable
class RewardScaling(Protocol):
    """Turns combined per-completion rewards into advantages (kind ``reward_scaling``)."""

    def advantages(self, rewards: Tensor, num_generations: int) -> Tensor:
        """(N,) rewards, NaN for unscorable rows, groups of ``num_generations`` consecutive
        rows -> (N,) advantages. NaN rows must not affect the statistics of their group; the
        core sets their advantage (and any other NaN) to 0 afterwards."""
        ...


@runtime_checkable
class RolloutCorrection(Protocol):
    """Weights that correct for a sampler that differs from the trained policy
    (kind ``rollout_correction``)."""

    def weights(
        self, old_per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor, cap: float
    ) -> Tensor:
        """(B, T) log-probs of the policy that is being corrected *to* (old) and of the sampler,
        both 0 at masked positions, the float mask and ``vllm_importance_sampling_cap`` ->
        (B, T) or (B, 1) weights multiplied into the per-token policy loss (detached by the
        core). A component may set the class attribute ``per_sequence = True`` when it gives one
        weight per sequence (the logged ratios then count every sequence, as TRL's sequence
        modes do; without it, (B, 1) weights are per sequence whenever T > 1)."""
        ...
