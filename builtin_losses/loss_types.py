"""The built-in loss types: grpo, bnpo, dr_grpo, dapo (GRPO's clipped surrogate, four
normalisations), and cispo and sapo (other per-token surrogates). TRL 1.x's definitions.

Each ``reduce`` receives the final (B, T) per-token loss (policy term after the rollout
correction, plus β·KL) and returns the micro-batch's scalar loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import LossInputs, LossType

if TYPE_CHECKING:
    from torch import Tensor


def _window_normaliser(inputs: LossInputs) -> Tensor:
    """dapo's denominator: the accumulation window's active tokens over all processes, per
    process (DDP averages gradients over processes). Without ``num_items_in_batch``, the local
    micro-batch's tokens times the accumulation steps."""
    if inputs.num_items_in_batch is None:
        return inputs.mask.sum().clamp(min=1.0) * inputs.gradient_accumulation_steps
    items = inputs.num_items_in_batch
    items = items if hasattr(items, "clamp") else inputs.mask.new_tensor(float(items))  # a plain number
    return items.clamp(min=1.0) / inputs.num_processes


class GRPO(LossType):
    """Mean over sequences of each sequence's token mean (original GRPO), / accumulation steps."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        m = inputs.mask
        per_sequence = (per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (B,)
        return per_sequence.mean() / inputs.gradient_accumulation_steps


class BNPO(LossType):
    """Token mean over the local micro-batch, / accumulation steps."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        m = inputs.mask
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0) / inputs.gradient_accumulation_steps


class DrGRPO(LossType):
    """Token sum / (B · max_completion_length), / accumulation steps (Dr. GRPO: no length bias)."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        if inputs.max_completion_length is None:
            raise GRPOPluginsError("loss_type 'dr_grpo' needs max_completion_length; set it")
        m = inputs.mask
        denominator = per_token_loss.size(0) * inputs.max_completion_length
        return (per_token_loss * m).sum() / denominator / inputs.gradient_accumulation_steps


class DAPO(LossType):
    """Token sum / active tokens of the whole optimizer step (all micro-batches and processes)."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        return (per_token_loss * inputs.mask).sum() / _window_normaliser(inputs)


class CISPO(DAPO):
    """MiniMax-M1's CISPO: ``-clamp(r, max=ε_high).detach() · A · logp``, dapo's reduction.

    ε_high is the cap on the importance weight itself here (ScaleRL recommends 5.0)."""

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        weight = inputs.ratio.clamp(max=inputs.epsilon_high).detach()
        return -weight * inputs.advantages * inputs.per_token_logps

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor]:
        clipped = (inputs.ratio > inputs.epsilon_high) & (inputs.advantages > 0)
        return {**super().metrics(inputs), "cispo_clip_ratio": clipped.float()}


class SAPO(GRPO):
    """Soft Adaptive Policy Optimization: ``-σ(τ(r-1)) · 4/τ · A`` with τ = temperature_pos for
    A > 0 and temperature_neg otherwise; grpo's reduction."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        temperature_pos: float = Field(1.0, gt=0, description="τ for tokens with positive advantage.")
        temperature_neg: float = Field(1.05, gt=0, description="τ for tokens with non-positive advantage.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        import torch

        a = inputs.advantages
        tau = torch.where(a > 0, a.new_tensor(self.params.temperature_pos), a.new_tensor(self.params.temperature_neg))
        return -((tau * (inputs.ratio - 1)).sigmoid() * 4 / tau) * a
