"""The component kinds and the small interface each one implements.

Every component has the same shape:

* an object registered under a name (a class, or for rewards also a plain function);
* optionally a pydantic model of its parameters, declared as the class attribute ``Params``;
* when a run uses it, the registry *builds* it: a class with ``Params`` is instantiated as
  ``cls(params)`` with the validated parameters, a class without as ``cls()``, and anything
  else (a function) is used as it is.

The base classes below document the interface of each kind; subclassing them is convenient but
not required (a class with the right methods is enough).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel

if TYPE_CHECKING:  # torch is imported lazily: `list` and `validate` must start in well under 1 s.
    from torch import Tensor

#: The kinds of component, in the order `grpo-plugins list` shows them, with the hook that
#: registers each.
KINDS: dict[str, str] = {
    "reward": "register_rewards",
    "loss_type": "register_loss_types",
    "importance_sampling": "register_importance_sampling_levels",
    "reward_scaling": "register_reward_scalings",
    "rollout_correction": "register_rollout_corrections",
    "generator": "register_generators",
    "task": "register_tasks",
}


# --------------------------------------------------------------------------------------------
# Objective components (used by grpo_plugins.objective.compute_loss; see docs/objective.md)
# --------------------------------------------------------------------------------------------


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
    extra: dict[str, Any] = field(default_factory=dict)


class LossType:
    """How the per-token policy loss is formed and reduced to a scalar (kind ``loss_type``).

    * ``per_token_loss`` returns the policy term, (B, T) or (B, 1), *before* the rollout
      correction and the KL term are applied; the default is GRPO's clipped surrogate
      (:func:`grpo_plugins.objective.clipped_surrogate`).
    * ``reduce`` turns the final per-token loss, always (B, T), into the micro-batch's scalar
      loss, including any division by ``gradient_accumulation_steps``. Multiply by
      ``inputs.mask`` and clamp every denominator (``.clamp(min=1.0)``): an all-masked batch
      must give exactly 0.
    * ``metrics`` returns per-token (B, T) or per-sequence (B, 1) values, each averaged over the
      active tokens (sequences) of the logged step; the default gives TRL's clip ratios.

    A loss type that only changes normalisation overrides ``reduce`` alone.
    """

    Params: ClassVar[type[BaseModel] | None] = None

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        from grpo_plugins.objective import clipped_surrogate

        return clipped_surrogate(inputs)

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        raise NotImplementedError

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor]:
        from grpo_plugins.objective import clip_indicators

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
        core)."""
        ...


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingSettings:
    """The sampling parameters of a run, as the config names them."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None


@dataclass
class GenerationOutput:
    """What a generator returns for B prompts; T = longest completion in the batch."""

    completion_ids: Tensor  # (B, T) long, right-padded with the pad token
    completion_mask: Tensor  # (B, T) long, 1 for tokens up to and including EOS
    is_truncated: Tensor  # (B,) bool: no EOS within max_completion_length
    sampling_logps: Tensor | None = None  # (B, T) log-probs of the sampled tokens, or None


class Generator:
    """A generation backend (kind ``generator``).

    Lifecycle: built with its params, then ``setup`` once with the model being trained, then
    ``generate`` once per generation cycle and ``on_weights_updated`` after each optimizer step
    (a backend holding its own copy of the weights syncs them there).
    """

    Params: ClassVar[type[BaseModel] | None] = None
    #: True when it samples with the trained model itself, so no sampler/trainer mismatch
    #: correction is needed (``vllm_importance_sampling_correction: auto`` stays off).
    samples_from_policy: ClassVar[bool] = True

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        raise NotImplementedError

    def on_weights_updated(self, model: Any) -> None:
        """Called after each optimizer step."""


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


class Task:
    """A named dataset plus its default rewards (kind ``task``).

    ``load`` returns a ``datasets.Dataset`` with a ``prompt`` column (a string, or a list of chat
    messages) and any other columns the rewards read (they reach reward functions as keyword
    arguments). ``default_rewards`` are used when the config names no rewards; entries are
    written as in the config (``"name"`` or ``{"name": ..., "weight": ..., "params": ...}``).
    """

    Params: ClassVar[type[BaseModel] | None] = None
    default_rewards: ClassVar[list[str | dict[str, Any]]] = []

    def load(self, seed: int) -> Any:
        raise NotImplementedError
