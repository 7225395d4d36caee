"""The objective pieces TRL 1.16 has beyond SPEC §6 -- top_entropy_quantile,
off_policy_mask_threshold, use_bias_correction_kl, the entropy bonus, the luspo and vespo loss
types and the rollout correction's lower bound (clip_min) -- checked three ways: against TRL's
own GRPOTrainer._compute_loss (loss, gradients of log-probs *and* entropies, metrics), against
an independent float64 re-derivation written token by token, and on all-masked batches."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer import grpo_trainer

from grpo_plugins.objective import BONUS_ENTROPY, compute_loss

GA, MAX_LEN, WINDOW = 2, 7, 23
Trainer = grpo_trainer.GRPOTrainer


class _FakeAccelerator:
    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1)

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return tensor


def _batch(all_masked: bool = False) -> dict:
    g = torch.Generator().manual_seed(5)
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    if all_masked:
        mask.zero_()
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    # Entropies representable in float32: TRL takes the quantile in float32 and compares the
    # (here float64) entropies with it, so with quantile 0 it would drop the top token too when
    # float32 rounding lifts the threshold above it. grpo-plugins stays in the entropies' dtype.
    ent = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).float().double()
    adv = torch.tensor([0.9, -1.2, 0.3, -0.4], dtype=torch.float64)
    return {"logp": logp, "old": old, "ref": ref, "sampling": sampling, "ent": ent, "adv": adv, "mask": mask}


def _is_weights(b: dict, mode: str, cap: float | None, clip_min: float | None) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (computed in _generate_and_score_completions)."""
    diff = ((b["old"] - b["sampling"]) * b["mask"]).nan_to_num(nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=cap)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if cap is None else cap
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _trl(b: dict, *, loss_type: str = "dapo", level: str = "token", beta: float = 0.0, quantile: float = 1.0,
         opm: float | None = None, bias_kl: bool = False, coef: float = 0.0, is_ratio: torch.Tensor | None = None,
         with_sampling: bool = False, vespo: tuple = (2.0, 3.0, 3.0, 2.0)) -> tuple:
    logp = b["logp"].clone().requires_grad_(True)
    ent = b["ent"].clone().requires_grad_(True)
    B, T = logp.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        aux_loss_enabled=False, top_entropy_quantile=quantile, off_policy_mask_threshold=opm,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        args=SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, sapo_temperature_pos=1.0,
                             sapo_temperature_neg=1.05, steps_per_generation=GA, entropy_target=0.2,
                             vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2],
                             vespo_lambda_neg=vespo[3]),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=GA, accelerator=_FakeAccelerator(),
        _entropy_bonus_enabled=coef != 0.0, use_adaptive_entropy=False, entropy_coef=coef,
        _metrics={"train": defaultdict(list)}, max_completion_length=MAX_LEN,
        get_off_policy_mask=Trainer.get_off_policy_mask, get_gamma_weights=Trainer.get_gamma_weights,
    )
    trainer.get_high_entropy_mask = lambda e, m, t: Trainer.get_high_entropy_mask(trainer, e, m, t)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
        "num_items_in_batch": torch.tensor(float(WINDOW)),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if with_sampling:
        inputs["sampling_per_token_logps"] = b["sampling"]
    loss = Trainer._compute_loss(trainer, None, inputs)
    loss.backward()
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return loss.detach(), logp.grad, grad_ent, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(b: dict, *, with_sampling: bool = False, correction: str | None = None, cap: float | None = 2.0,
          clip_min: float | None = None, **settings) -> tuple:
    logp = b["logp"].clone().requires_grad_(True)
    ent = b["ent"].clone().requires_grad_(True)
    extra = {}
    if correction is not None:
        extra = {"rollout_correction": {"name": correction, "params": {"clip_min": clip_min}},
                 "vllm_importance_sampling_cap": cap}
    loss, metrics = compute_loss(
        logp, b["old"], b["adv"], b["mask"], ref_per_token_logps=b["ref"],
        sampling_per_token_logps=b["sampling"] if (with_sampling or correction) else None,
        vllm_importance_sampling_correction=correction is not None,
        epsilon=0.2, epsilon_high=0.28, max_completion_length=MAX_LEN, num_items_in_batch=WINDOW,
        gradient_accumulation_steps=GA, entropies=ent, **extra, **settings,
    )
    loss.backward()
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return loss.detach(), logp.grad, grad_ent, metrics


def _close(ours: tuple, theirs: tuple, names: tuple[str, ...] = ()) -> None:
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-9, atol=1e-12)
    for name in names:
        assert ours[3][name] == pytest.approx(theirs[3][name], rel=1e-6, abs=1e-9), name


# -- against TRL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("quantile", [0.0, 0.3, 0.8])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_top_entropy_quantile_matches_trl(quantile, loss_type):
    b = _batch()
    _close(_ours(b, loss_type=loss_type, top_entropy_quantile=quantile), _trl(b, loss_type=loss_type, quantile=quantile),
           ("clip_ratio/region_mean",))


@pytest.mark.parametrize("with_sampling", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.01, 0.2])
def test_off_policy_mask_matches_trl(threshold, with_sampling):
    b = _batch()
    _close(_ours(b, off_policy_mask_threshold=threshold, with_sampling=with_sampling),
           _trl(b, opm=threshold, with_sampling=with_sampling))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_kl", [False, True])
def test_bias_corrected_kl_matches_trl(level, bias_kl):
    b = _batch()
    _close(_ours(b, beta=0.05, importance_sampling_level=level, use_bias_correction_kl=bias_kl),
           _trl(b, beta=0.05, level=level, bias_kl=bias_kl), ("kl",))


@pytest.mark.parametrize("quantile", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_entropy_bonus_matches_trl_including_the_entropy_gradient(loss_type, quantile):
    b = _batch()
    ours = _ours(b, loss_type=loss_type, entropy_coef=0.03, top_entropy_quantile=quantile)
    theirs = _trl(b, loss_type=loss_type, coef=0.03, quantile=quantile)
    _close(ours, theirs)
    assert theirs[2].abs().sum() > 0  # the bonus really reaches the entropies


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_luspo_matches_trl(level, beta):
    b = _batch()
    _close(_ours(b, loss_type="luspo", importance_sampling_level=level, beta=beta),
           _trl(b, loss_type="luspo", level=level, beta=beta), ("clip_ratio/low_mean", "clip_ratio/high_mean"))


@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
def test_vespo_matches_trl(mode):
    b = _batch()
    params = {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 3.5, "lambda_neg": 1.5}
    ratio = _is_weights(b, mode, 1.3, 0.6) if mode else None
    ours = _ours(b, loss_type={"name": "vespo", "params": params}, correction=mode, cap=1.3, clip_min=0.6)
    theirs = _trl(b, loss_type="vespo", is_ratio=ratio, vespo=(1.5, 2.5, 3.5, 1.5))
    _close(ours, theirs)
    # TRL averages phi over every row (x.shape[0]); here over rows with an active token: all are.
    assert ours[3]["vespo/phi_seq_mean"] == pytest.approx(theirs[3]["vespo/phi_seq_mean"], rel=1e-6)  # float32 metric


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("cap", "clip_min"), [(1.6, 0.7), (None, 0.7), (1.6, None)])
def test_rollout_correction_bounds_match_trl(mode, cap, clip_min):
    if mode.endswith("truncate") and cap is None and clip_min is None:
        pytest.skip("TRL rejects a truncate mode without bounds")
    b = _batch()
    ours = _ours(b, correction=mode, cap=cap, clip_min=clip_min)
    _close(ours, _trl(b, is_ratio=_is_weights(b, mode, cap, clip_min)))


def test_off_policy_mask_uses_the_sampler_log_probs_under_a_correction_like_trl():
    b = _batch()
    ratio = _is_weights(b, "token_truncate", 2.0, None)
    _close(_ours(b, off_policy_mask_threshold=0.05, correction="token_truncate", cap=2.0),
           _trl(b, opm=0.05, is_ratio=ratio, with_sampling=True))


# -- against an independent float64 re-derivation -------------------------------------------------


def reference(b: dict, *, loss_type: str = "dapo", quantile: float = 1.0, opm: float | None = None,
              beta: float = 0.0, bias_kl: bool = False, coef: float = 0.0, rho_mode: str | None = None,
              cap: float | None = None, clip_min: float | None = None,
              vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)) -> torch.Tensor:
    """Token by token from the papers' formulas (token-level IS), float64."""
    logp, old, ref, samp, ent, mask = b["logp_var"], b["old"], b["ref"], b["sampling"], b["ent_var"], b["mask"]
    B, T = mask.shape
    act = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    # entropy threshold: linear-interpolated quantile of the active entropies (numpy's default)
    vals = sorted(float(ent[i, t].detach()) for i, t in act)
    keep = set(act)
    if quantile < 1.0 and vals:
        pos = (1 - quantile) * (len(vals) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        thr = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
        keep = {(i, t) for i, t in act if float(ent[i, t]) >= thr}
    def bounded(rho: float) -> float:  # the rollout correction's weight for one token
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if cap is None else cap
        if rho_mode.endswith("truncate"):
            return min(max(rho, low), high)
        return 0.0 if (rho > high or rho < low) else rho

    total = torch.tensor(0.0, dtype=torch.float64)
    rows = []
    for i in range(B):
        a = float(b["adv"][i])
        toks = [t for t in range(T) if mask[i, t]]
        n = len(toks)
        seq_keep = 1.0
        if opm is not None:
            kl_mean = sum(float(samp[i, t] - logp[i, t]) for t in toks) / max(n, 1)
            seq_keep = 1.0 if (a >= 0 or kl_mean <= opm) else 0.0
        log_w = sum(max(min(float(logp[i, t] - old[i, t]), 20.0), -20.0) for t in toks)
        if rho_mode is not None and loss_type == "vespo":
            for t in toks:
                rho = bounded(math.exp(float(old[i, t] - samp[i, t])))
                log_w += max(min(math.log(rho) if rho > 0 else -math.inf, 20.0), math.log(1e-8))
        log_w = max(min(log_w, 20.0), math.log(1e-8))
        k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        row = torch.tensor(0.0, dtype=torch.float64)
        for t in toks:
            r = torch.exp(logp[i, t] - old[i, t])
            if loss_type == "vespo":
                term = -phi * a * logp[i, t]
            else:
                term = -torch.minimum(r * a, torch.clamp(r, 0.8, 1.28) * a)
            term = term * seq_keep * (1.0 if (i, t) in keep else 0.0)
            if rho_mode is not None and loss_type != "vespo":
                term = term * bounded(math.exp(float(old[i, t] - samp[i, t])))
            if beta:
                d = ref[i, t] - logp[i, t]
                k3 = torch.exp(d) - d - 1
                term = term + beta * (k3 * r if bias_kl else k3)
            row = row + term
        rows.append(row)
        total = total + row
    if loss_type == "luspo":
        loss = sum(rows) / B / GA
    else:  # dapo, vespo
        loss = total / WINDOW
    if coef:
        bonus_tokens = [(i, t) for i, t in act if (i, t) in keep]
        h = sum((ent[i, t] for i, t in bonus_tokens), torch.tensor(0.0, dtype=torch.float64))
        loss = loss - coef * h / max(len(bonus_tokens), 1) / GA
    return loss


CASES = [
    ({"top_entropy_quantile": 0.4}, {"quantile": 0.4}),
    ({"off_policy_mask_threshold": 0.05, "sampling": True}, {"opm": 0.05}),
    ({"beta": 0.04, "use_bias_correction_kl": True}, {"beta": 0.04, "bias_kl": True}),
    ({"entropy_coef": 0.02, "top_entropy_quantile": 0.5}, {"coef": 0.02, "quantile": 0.5}),
    ({"loss_type": "luspo", "beta": 0.04}, {"loss_type": "luspo", "beta": 0.04}),
    ({"loss_type": "vespo"}, {"loss_type": "vespo"}),
    ({"loss_type": "vespo", "correction": "token_truncate", "cap": 1.4}, {"loss_type": "vespo", "rho_mode": "token_truncate", "cap": 1.4}),
    ({"correction": "token_mask", "cap": 1.7, "clip_min": 0.5}, {"rho_mode": "token_mask", "cap": 1.7, "clip_min": 0.5}),
]


@pytest.mark.parametrize(("ours", "expected"), CASES, ids=[str(sorted(c[0])) for c in CASES])
def test_matches_the_float64_re_derivation_loss_and_gradient(ours, expected):
    b = _batch()
    settings = dict(ours)
    with_sampling = settings.pop("sampling", False)
    correction, cap, clip_min = settings.pop("correction", None), settings.pop("cap", 2.0), settings.pop("clip_min", None)
    loss, grad, grad_ent, _ = _ours(b, with_sampling=with_sampling, correction=correction, cap=cap, clip_min=clip_min, **settings)

    b["logp_var"] = b["logp"].clone().requires_grad_(True)
    b["ent_var"] = b["ent"].clone().requires_grad_(True)
    want = reference(b, **expected)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, b["logp_var"].grad, rtol=1e-9, atol=1e-12)
    want_ent = b["ent_var"].grad if b["ent_var"].grad is not None else torch.zeros_like(grad_ent)
    torch.testing.assert_close(grad_ent, want_ent, rtol=1e-9, atol=1e-12)


# -- all-masked batches ------------------------------------------------------------------------------


@pytest.mark.parametrize(("ours", "expected"), CASES, ids=[str(sorted(c[0])) for c in CASES])
def test_an_all_masked_batch_gives_zero_loss_zero_gradient_finite_metrics(ours, expected):
    b = _batch(all_masked=True)
    b["logp"][0, 0] = float("nan")  # padding may hold anything
    settings = dict(ours)
    with_sampling = settings.pop("sampling", False)
    correction, cap, clip_min = settings.pop("correction", None), settings.pop("cap", 2.0), settings.pop("clip_min", None)
    loss, grad, grad_ent, metrics = _ours(b, with_sampling=with_sampling, correction=correction, cap=cap,
                                          clip_min=clip_min, **settings)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert torch.equal(grad_ent, torch.zeros_like(grad_ent))
    assert all(math.isfinite(v) for v in metrics.values())


def test_the_bonus_entropy_metric_is_the_mean_over_the_tokens_it_acts_on():
    b = _batch()
    _, _, _, metrics = _ours(b, entropy_coef=0.1)
    m = b["mask"].double()
    assert metrics[BONUS_ENTROPY] == pytest.approx(float((b["ent"] * m).sum() / m.sum()), rel=1e-6)  # metrics are float32


def test_an_off_policy_threshold_of_0_masks_sequences_like_trl():
    """0 is a threshold (drop every negative-advantage sequence whose sampler was more confident
    than the policy), not "off": the loss differs from no mask, and equals TRL's."""
    b = _batch()
    b["sampling"][1] = b["logp"][1] + 0.01  # row 1 (A < 0): mean KL 0.01 > 0, dropped
    b["sampling"][3] = b["logp"][3] - 0.01  # row 3 (A < 0): mean KL -0.01 <= 0, kept
    masked, unmasked = _ours(b, off_policy_mask_threshold=0.0, with_sampling=True), _ours(b, with_sampling=True)
    assert masked[1][1].abs().sum() == 0 and unmasked[1][1].abs().sum() > 0
    torch.testing.assert_close(masked[1][3], unmasked[1][3])
    _close(masked, _trl(b, opm=0.0, with_sampling=True))
