"""The built-in loss types: grpo, bnpo, dr_grpo, dapo (GRPO's clipped surrogate, four
normalisations), and cispo and sapo (other per-token surrogates). TRL 1.x's definitions.

Each ``reduce`` receives the final (B, T) per-token loss (policy term after the rollout
correction, plus β·KL) and returns the micro-batch's scalar loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import LossInputs, LossType, RowExtremum

if TYPE_CHECKING:
    from torch import Tensor


def _window_normaliser(inputs: LossInputs) -> Tensor:
    """dapo's denominator: the accumulation window's active tokens over all processes, per
    process (DDP averages gradients over processes). Without ``num_items_in_batch``, the local
    micro-batch's tokens times the accumulation steps."""
    if inputs.num_items_in_batch is None:
        return inputs.mask.sum().clamp(min=1.0) * inputs.gradient_accumulation_steps
    items = inputs.num_items_in_batch
    items = items if hasattr(items, "clamp") else inputs.mask.new_full((), float(items))  # a plain number
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

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor | RowExtremum]:
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
        tau = torch.where(a > 0, a.new_full((), self.params.temperature_pos), a.new_full((), self.params.temperature_neg))
        return -((tau * (inputs.ratio - 1)).sigmoid() * 4 / tau) * a


class LUSPO(LossType):
    """Length-Unbiased Sequence Policy Optimization: GRPO's clipped surrogate, each sequence's
    token losses *summed* (a sequence weighs by its length), mean over sequences, / accumulation
    steps. Meant for ``importance_sampling_level: sequence`` (a GSPO variant)."""

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        per_sequence = (per_token_loss * inputs.mask).sum(-1)  # (B,)
        return per_sequence.mean() / inputs.gradient_accumulation_steps


class VESPO(DAPO):
    """Variational Sequence-Level Soft Policy Optimization: ``-φ(w) · A · logp`` with the
    detached Gamma weight φ(w) = e^λ · w^k · e^(-λw) of the sequence ratio
    w = exp(Σ_t clamp(log r_t, ±20) [+ Σ_t log ρ_t]) (ρ: the rollout correction's token weights,
    folded in here instead of multiplied), (k, λ) = (k_pos, λ_pos) for A ≥ 0 else (k_neg, λ_neg);
    dapo's reduction. Uses the per-token log-ratios whatever ``importance_sampling_level`` is."""

    applies_rollout_correction = True

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        k_pos: float = Field(2.0, description="Power k for A >= 0 (down-weights ratios < 1).")
        lambda_pos: float = Field(3.0, description="Decay λ for A >= 0 (down-weights ratios > 1).")
        k_neg: float = Field(3.0, description="Power k for A < 0.")
        lambda_neg: float = Field(2.0, description="Decay λ for A < 0.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def gamma_weights(self, inputs: LossInputs) -> Tensor:
        """φ(w) per sequence, (B, 1), detached; 0 where it is not finite."""
        import math

        import torch

        p = self.params
        with torch.no_grad():
            lower = math.log(1e-8)
            seq = (inputs.log_ratio.clamp(-20.0, 20.0) * inputs.mask).sum(-1, keepdim=True)  # (B, 1)
            rho = inputs.rollout_weights
            if rho is not None:
                if rho.shape[-1] != inputs.mask.shape[-1]:
                    raise GRPOPluginsError(
                        "loss_type 'vespo' needs a token-level rollout correction (token_truncate or "
                        "token_mask), as in TRL; set rollout_correction accordingly"
                    )
                seq = seq + rho.log().clamp(lower, 20.0).sum(-1, keepdim=True)
            log_w = seq.clamp(lower, 20.0)  # (B, 1)
            nonneg = inputs.advantages >= 0
            k = torch.where(nonneg, log_w.new_full((), p.k_pos), log_w.new_full((), p.k_neg))
            lam = torch.where(nonneg, log_w.new_full((), p.lambda_pos), log_w.new_full((), p.lambda_neg)).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * log_w.exp())
            return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        return -self.gamma_weights(inputs) * inputs.advantages * inputs.per_token_logps

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor | RowExtremum]:
        return {"vespo/phi_seq_mean": self.gamma_weights(inputs)}  # (B, 1): averaged over every row, as in TRL
