"""verl's "seq-mean-token-sum" loss aggregation as a grpo-plugins loss type.

A loss type that only changes how the per-token loss is normalised overrides ``reduce`` alone;
the per-token clipped surrogate, the rollout correction and the KL term come from the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_plugins import hookimpl
from grpo_plugins.kinds import LossInputs, LossType

if TYPE_CHECKING:  # torch is not imported at registration time
    from torch import Tensor


class SeqMeanTokenSum(LossType):
    """verl's seq-mean-token-sum: sum each sequence's token losses, average over the sequences of
    the micro-batch, divide by gradient_accumulation_steps. Long completions weigh more."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        per_sequence = (per_token_loss * inputs.mask).sum(dim=-1)  # (B,)
        return per_sequence.mean() / inputs.gradient_accumulation_steps


@hookimpl
def register_loss_types(register: Any) -> None:
    register(SeqMeanTokenSum, name="seq_mean_token_sum")
