"""The clipped policy-gradient objective of GRPO as a pure tensor function (docs/objective.md).

:func:`compute_loss` wires together three components -- an importance-sampling level, a loss
type and (when on) a rollout correction -- plus the k3 KL term. Its settings are one frozen
:class:`Objective`, built once (components looked up in the registry by name then) and passed to
every call. It knows no component by name: the built-in ones live in ``builtin_losses`` and are
found exactly like a third party's. docs/objective.md has the formulas and how to write a
component.

NaN safety: log-probabilities are zeroed at masked positions before anything else, every
denominator is clamped, and metrics are kept as global sums and counts (:class:`LossMetrics`),
so an all-masked micro-batch gives a loss of exactly 0, a zero gradient and finite metrics.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from grpo_plugins.kinds import LossInputs, RowExtremum
from grpo_plugins.loss_metrics import LossMetrics
from grpo_plugins.registry import ComponentSpecError, Registry, resolve_component

if TYPE_CHECKING:
    from grpo_plugins.config import GRPOConfig


class LossSettingsError(ComponentSpecError):
    """A setting of :func:`compute_loss` is unknown, missing or inconsistent."""


#: The component settings of :class:`Objective` and the registry kind each one names.
_COMPONENT_KINDS = {
    "loss_type": "loss_type",
    "importance_sampling_level": "importance_sampling",
    "rollout_correction": "rollout_correction",
}


@dataclass(frozen=True)
class Objective:
    """The settings of :func:`compute_loss`, resolved once (docs/objective.md): the defaults of
    the loss live here and nowhere else.

    Component fields take a registered name (or ``dist:name``), a ``{name, params}`` mapping or
    ComponentRef, a component class or a built component; the constructor builds them from
    ``registry`` (default: the process-wide one), so an Objective always holds built components.
    Values are checked once, here; a micro-step derives a variant with
    :func:`dataclasses.replace` (e.g. the adaptive ``entropy_coef``, or a row chunk's
    :class:`~grpo_plugins.row_chunks.ChunkedReduction` as ``loss_type``), which only re-checks a
    few numbers.
    """

    loss_type: Any = "dapo"  #: a LossType once built
    importance_sampling_level: Any = "token"  #: an ImportanceSampling once built
    rollout_correction: Any = "token_truncate"  #: a RolloutCorrection once built
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    vllm_importance_sampling_correction: bool | Literal["auto"] = "auto"
    vllm_importance_sampling_cap: float | None = 2.0  # None: no upper bound
    use_bias_correction_kl: bool = False  # TRL 1.16's default is True; see docs/objective.md
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    registry: InitVar[Registry | None] = None

    def __post_init__(self, registry: Registry | None) -> None:
        for name, kind in _COMPONENT_KINDS.items():  # a built component is kept as it is
            object.__setattr__(self, name, resolve_component(kind, getattr(self, name), registry))
        for name in ("epsilon", "beta", "top_entropy_quantile", "entropy_coef"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("epsilon_high", "off_policy_mask_threshold"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise LossSettingsError(f"top_entropy_quantile must be in [0, 1] (got {self.top_entropy_quantile})")
        setting = self.vllm_importance_sampling_correction
        if not isinstance(setting, bool) and setting != "auto":
            raise LossSettingsError(
                f"vllm_importance_sampling_correction must be true, false or 'auto' (got {setting!r})"
            )

    @classmethod
    def from_config(cls, config: GRPOConfig, registry: Registry | None = None) -> Objective:
        """The objective of a run config, its components built from ``registry`` (what the
        engine builds once per run)."""
        return cls(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}, registry=registry
        )

    @classmethod
    def from_settings(cls, **settings: Any) -> Objective:
        """From :func:`compute_loss`'s keyword settings (and ``registry``): an unknown name is a
        :class:`LossSettingsError` that suggests the closest one."""
        names = [f.name for f in dataclasses.fields(cls)] + ["registry"]
        unknown = [key for key in settings if key not in names]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise LossSettingsError(f"compute_loss got an unknown setting '{key}'{hint} Settings: {', '.join(names)}.")
        return cls(**settings)

    @property
    def resolved_epsilon_high(self) -> float:
        """The upper clip: ``epsilon_high``, or ``epsilon`` when that is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


#: The metric compute_loss reports when the entropy bonus is on: the mean entropy over the tokens
#: the bonus acts on (what adaptive entropy control measures).
BONUS_ENTROPY = "entropy_bonus/entropy"

IS_RATIO_PREFIX = "sampling/importance_sampling_ratio"
#: |old - sampler| log-prob per active token, logged whenever the sampler's log-probs are given.
LOGP_DIFFERENCE_PREFIX = "sampling/sampling_logp_difference"


def _correction_enabled(setting: bool | str, sampling_per_token_logps: Tensor | None) -> bool:
    # "auto" corrects exactly when the sampler is not the trained policy; a caller says so by
    # passing the sampler's log-probs (under "auto" the engine keeps them only then; see
    # grpo_plugins.rollout.keeps_sampling_logps).
    if setting == "auto":
        return sampling_per_token_logps is not None
    if setting and sampling_per_token_logps is None:
        raise LossSettingsError(
            "vllm_importance_sampling_correction is true but no sampling_per_token_logps were given;"
            " pass the sampler's log-probs or set it to 'auto' or false"
        )
    return bool(setting)


# -- metrics ---------------------------------------------------------------------------------


def _masked_stats(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, count) of per-token (B, T) values over the active tokens, or of per-sequence (B, 1)
    values over *every* row: TRL's definition (its test is the last dimension being 1), so a
    row without an active token counts with its value (ratio 1: not clipped, φ = 1)."""
    if values.shape[-1] == 1:
        return values.sum(), values.new_full((), float(values.shape[0]))
    return (values * mask).sum(), mask.sum()


def _row_extremum(values: Tensor, mask: Tensor, reduce: str) -> Tensor:
    """Min or max over rows of each row's mean over its active tokens (rows without one left
    out), or of the (B, 1) per-row values (every row): TRL's ``clip_ratio/low_min`` and
    ``high_max``. +inf / -inf when no row counts."""
    if values.shape[-1] == 1:
        rows, counted = values[:, 0], torch.ones_like(values[:, 0], dtype=torch.bool)  # (B,) (B,)
    else:
        n = mask.sum(-1)  # (B,)
        rows, counted = (values * mask).sum(-1) / n.clamp(min=1.0), n > 0  # (B,) (B,)
    if reduce == "min":
        return torch.where(counted, rows, rows.new_full((), float("inf"))).amin()
    if reduce == "max":
        return torch.where(counted, rows, rows.new_full((), float("-inf"))).amax()
    raise LossSettingsError(f"a RowExtremum metric reduces by 'min' or 'max', not {reduce!r}")


# -- the objective ---------------------------------------------------------------------------


def high_entropy_mask(entropies: Tensor, mask: Tensor, quantile: float, pool: Tensor | None = None) -> Tensor:
    """TRL's ``top_entropy_quantile`` mask: 1 for active tokens whose entropy is at least the
    (1 - quantile) quantile of the active tokens' entropies (of ``pool`` when given: the
    entropies of every process), else 0. (B, T) float."""
    active = mask != 0
    ent = entropies.detach()
    values = ent[active] if pool is None else pool.detach().to(ent.dtype)
    if values.numel() == 0:
        return torch.zeros_like(mask)
    # In the entropies' own dtype (TRL casts to float32 first, which can round the threshold
    # above the top token in a float64 run).
    values = values if values.dtype in (torch.float32, torch.float64) else values.float()
    threshold = torch.quantile(values, 1.0 - quantile)
    keep = ent * mask >= threshold
    return (keep & active).to(mask.dtype)


def off_policy_mask(
    advantages: Tensor, per_token_logps: Tensor, reference_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): drop a
    sequence (0) when its advantage is negative and its mean token KL(sampler || policy),
    ``mean_t(reference - logp)``, exceeds ``threshold``; keep (1) otherwise. (B, 1)."""
    kl = torch.nan_to_num(reference_logps - per_token_logps.detach(), nan=0.0)  # (B, T)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def compute_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    ref_per_token_logps: Tensor | None = None,
    sampling_per_token_logps: Tensor | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    entropies: Tensor | None = None,
    entropy_pool: Tensor | None = None,
    objective: Objective | None = None,
    **settings: Any,
) -> tuple[Tensor, LossMetrics]:
    """The GRPO loss of one micro-batch and its metrics (docs/objective.md; TRL 1.x's definitions).

    Args:
        per_token_logps: (B, T) log-probs of the completion tokens under the current policy
            (carries the gradient).
        old_per_token_logps: (B, T) log-probs under the policy that generated the batch; None
            means exactly on-policy (``per_token_logps.detach()``).
        advantages: (B,) one advantage per completion (or (B, T) per token).
        completion_mask: (B, T) 1 for completion tokens that count, after truncation masking.
        ref_per_token_logps: (B, T) reference-model log-probs; required when ``beta != 0``.
        sampling_per_token_logps: (B, T) log-probs reported by the sampler, when it is not the
            policy itself: read by the rollout correction, the off-policy mask and the
            ``sampling/sampling_logp_difference`` metrics.
        num_items_in_batch: active tokens of the whole optimizer step (every micro-batch that
            accumulates into it, on every process); the normaliser of dapo and cispo. None: the
            local micro-batch's tokens times ``gradient_accumulation_steps``.
        num_processes: data-parallel processes (gradients are averaged across them).
        gradient_accumulation_steps: micro-batches per optimizer step (for loss types that
            divide by it).
        entropies: (B, T) entropy of each position's sampling distribution; needed by
            ``top_entropy_quantile < 1`` and ``entropy_coef != 0`` (it must carry the gradient
            for the entropy bonus).
        entropy_pool: the active tokens' entropies over which the ``top_entropy_quantile``
            threshold is taken (all processes'); None: this micro-batch's.
        objective: the loss settings, resolved (:class:`Objective`); what a training loop
            passes, built once.
        **settings: instead of ``objective``, the fields of :class:`Objective` by keyword
            (``loss_type``, ``epsilon``, ``beta``, ..., and ``registry``); they build an
            Objective for this call, with the same defaults and checks.

    Returns:
        ``(loss, metrics)``: the scalar loss to backpropagate and a :class:`LossMetrics`.
    """
    if objective is None:
        objective = Objective.from_settings(**settings)
    elif settings:
        raise LossSettingsError(
            f"compute_loss got objective= and the settings {', '.join(settings)}; pass one or the other"
            " (dataclasses.replace(objective, ...) changes a setting)"
        )
    loss_type, level = objective.loss_type, objective.importance_sampling_level
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise LossSettingsError(
            "per_token_logps and completion_mask must both be (B, T); got "
            f"{tuple(per_token_logps.shape)} and {tuple(completion_mask.shape)}"
        )
    quantile, entropy_coef = objective.top_entropy_quantile, objective.entropy_coef
    if (quantile < 1.0 or entropy_coef != 0.0) and entropies is None:
        raise LossSettingsError(
            "top_entropy_quantile < 1 and entropy_coef != 0 need the per-token entropies: pass entropies=..."
        )
    dtype, device = per_token_logps.dtype, per_token_logps.device
    mask = completion_mask.to(dtype)  # (B, T)
    active = mask != 0  # (B, T)
    zero = torch.zeros((), dtype=dtype, device=device)

    def clean(x: Tensor) -> Tensor:  # padding may hold anything; nothing of it reaches the loss
        return torch.where(active, x.to(dtype), zero)

    logps = clean(per_token_logps)  # (B, T)
    old = logps.detach() if old_per_token_logps is None else clean(old_per_token_logps.detach())
    log_ratio = logps - old  # (B, T)
    log_weights = level.log_weights(log_ratio, mask)  # (B, T) or (B, 1)
    advantages = advantages.to(dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)

    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(dtype=dtype, device=device)
    elif num_items_in_batch is not None:  # filled on the device: a copy from the host would wait for its queue
        num_items_in_batch = torch.full((), float(num_items_in_batch), dtype=dtype, device=device)

    sampling = None if sampling_per_token_logps is None else clean(sampling_per_token_logps.detach())  # (B, T)
    correction, corrector = None, None
    if _correction_enabled(objective.vllm_importance_sampling_correction, sampling_per_token_logps):
        corrector = objective.rollout_correction
        assert sampling is not None
        cap = objective.vllm_importance_sampling_cap
        cap = float("inf") if cap is None else float(cap)
        correction = corrector.weights(old, sampling, mask, cap).detach()  # (B, T) or (B, 1)

    inputs = LossInputs(
        per_token_logps=logps,
        old_per_token_logps=old,
        advantages=advantages,
        mask=mask,
        log_ratio=log_ratio,
        log_weights=log_weights,
        ratio=torch.exp(log_weights),
        epsilon_low=objective.epsilon,
        epsilon_high=objective.resolved_epsilon_high,
        delta=objective.delta,
        max_completion_length=objective.max_completion_length,
        num_items_in_batch=num_items_in_batch,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        rollout_weights=correction,
    )
    per_token = loss_type.per_token_loss(inputs)  # (B, T) or (B, 1)

    if objective.off_policy_mask_threshold is not None:
        # The sampler's log-probs whenever they are given (the engine keeps them whenever the
        # sampler is not the trained policy, e.g. vLLM), else the old policy's: TRL's choice.
        reference = old if sampling is None else sampling
        per_token = per_token * off_policy_mask(advantages, logps, reference, mask, objective.off_policy_mask_threshold)
    entropy_mask = None
    if quantile < 1.0:
        assert entropies is not None
        entropy_mask = high_entropy_mask(entropies, mask, quantile, entropy_pool)  # (B, T)
        per_token = per_token * entropy_mask
    if correction is not None and not getattr(loss_type, "applies_rollout_correction", False):
        per_token = per_token * correction

    beta = objective.beta
    kl = None
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise LossSettingsError("beta is not 0 but no ref_per_token_logps were given")
        ref_minus = clean(ref_per_token_logps.detach()) - logps  # (B, T)
        kl = torch.exp(ref_minus) - ref_minus - 1  # (B, T) k3 estimator
        kl_term = kl * inputs.ratio if objective.use_bias_correction_kl else kl  # DeepSeek-V3.2's unbiased KL
        per_token = per_token + beta * kl_term
        kl = kl_term  # logged as TRL logs it (with the ratio when bias-corrected)

    per_token = per_token.expand_as(mask)  # (B, T)
    loss = loss_type.reduce(per_token, inputs)
    bonus = None
    if entropies is not None:
        # The mean entropy over the tokens the policy term acts on, whatever the loss type's
        # normalisation (TRL's definition), scaled only for gradient accumulation.
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask  # (B, T)
        bonus = ((clean(entropies) * bonus_mask).sum(), bonus_mask.sum())
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * bonus[0] / bonus[1].clamp(min=1.0) / gradient_accumulation_steps
    return loss, _metrics(loss_type, inputs, kl, correction, corrector, sampling, bonus)


def _metrics(
    loss_type: Any,
    inputs: LossInputs,
    kl: Tensor | None,
    correction: Tensor | None,
    corrector: Any,
    sampling: Tensor | None,
    bonus: tuple[Tensor, Tensor] | None = None,
) -> LossMetrics:
    mask = inputs.mask
    active = mask != 0  # (B, T)
    with torch.no_grad():
        means: dict[str, tuple[Tensor, Tensor]] = {}
        mins: dict[str, Tensor] = {}
        maxs: dict[str, Tensor] = {}
        for name, values in loss_type.metrics(inputs).items():
            if isinstance(values, RowExtremum):
                extremum = _row_extremum(values.values.detach().to(mask.dtype), mask, values.reduce)
                (mins if values.reduce == "min" else maxs)[name] = extremum
            else:
                means[name] = _masked_stats(values.detach().to(mask.dtype), mask)
        if kl is not None:
            means["kl"] = _masked_stats(kl, mask)
        if bonus is not None:
            means[BONUS_ENTROPY] = (bonus[0].detach(), bonus[1])
        process_means = []
        if correction is not None:
            # TRL: a sequence mode's ratios over every sequence, a token mode's over active tokens.
            per_sequence = correction.shape[-1] == 1 and bool(getattr(corrector, "per_sequence", mask.shape[-1] > 1))
            where = torch.ones_like(correction, dtype=torch.bool) if per_sequence else active  # (B, 1) or (B, T)
            values = correction.expand_as(where)
            inf = values.new_full((), float("inf"))
            mins[f"{IS_RATIO_PREFIX}/min"] = torch.where(where, values, inf).amin()
            means[f"{IS_RATIO_PREFIX}/mean"] = (torch.where(where, values, 0.0).sum(), where.sum().to(values.dtype))
            maxs[f"{IS_RATIO_PREFIX}/max"] = torch.where(where, values, -inf).amax()
            process_means.append(f"{IS_RATIO_PREFIX}/mean")
        if sampling is not None:
            # TRL's sampler/trainer gap: over active tokens whose sampler log-prob is not NaN.
            delta = (inputs.old_per_token_logps - sampling).abs()  # (B, T)
            seen = active & ~delta.isnan()
            means[f"{LOGP_DIFFERENCE_PREFIX}/mean"] = (torch.where(seen, delta, 0.0).sum(), seen.sum().to(delta.dtype))
            maxs[f"{LOGP_DIFFERENCE_PREFIX}/max"] = torch.where(seen, delta, delta.new_full((), float("-inf"))).amax()
            process_means.append(f"{LOGP_DIFFERENCE_PREFIX}/mean")
        return LossMetrics.from_parts(means, mins, maxs, process_means=process_means, device=mask.device)
