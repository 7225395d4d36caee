"""compute_loss against an independent float64 re-derivation of SPEC §6 (TRL 1.x's definitions),
for loss and gradient, over every loss type x IS level x delta x beta x rollout correction."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grpo_plugins.objective import LossMetrics, compute_loss

torch.set_default_dtype(torch.float32)  # the reference is float64 by construction, not by default

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
LEVELS = ["token", "sequence"]
CORRECTIONS = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
EPS, EPS_HIGH, CAP, MAX_LEN = 0.2, 0.28, 1.6, 8
CISPO_EPS_HIGH = 1.2  # cispo caps the weight itself at eps_high; 1.2 clips some ratios, not all
GA, NPROC, NUM_ITEMS = 3, 2, 37


# -- the reference: written token by token from the formulas, nothing shared with the code -------


def reference_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: list[float],
    mask: list[list[int]],
    *,
    loss_type: str,
    level: str,
    eps: float,
    eps_high: float,
    delta: float | None,
    beta: float,
    ref: torch.Tensor | None,
    sampling: torch.Tensor | None,
    correction: str | None,
    cap: float,
    max_len: int,
    num_items: float | None,
    nproc: int,
    ga: int,
) -> torch.Tensor:
    B, T = logp.shape
    per_row_sums, row_counts = [], []
    for i in range(B):
        active = [t for t in range(T) if mask[i][t]]
        n_i = len(active)
        a = adv[i]
        if level == "sequence":
            seq_w = sum((logp[i, t] - old[i, t] for t in active), torch.tensor(0.0, dtype=torch.float64))
            seq_w = seq_w / max(n_i, 1)
        if correction is not None and correction.startswith("sequence"):
            seq_rho = math.exp(sum(float(old[i, t] - sampling[i, t]) for t in active))
        row_sum = torch.tensor(0.0, dtype=torch.float64)
        for t in active:
            w = logp[i, t] - old[i, t] if level == "token" else seq_w
            r = torch.exp(w)
            if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
                r_clip = torch.clamp(r, 1 - eps, 1 + eps_high)
                r_unclipped = torch.clamp(r, max=delta) if delta is not None else r
                term = -torch.minimum(r_unclipped * a, r_clip * a)
            elif loss_type == "cispo":
                term = -min(float(r.detach()), eps_high) * a * logp[i, t]
            else:  # sapo
                tau = 1.0 if a > 0 else 1.05
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            if correction is not None:
                rho = math.exp(float(old[i, t] - sampling[i, t])) if correction.startswith("token") else seq_rho
                if correction.endswith("truncate"):
                    rho = min(rho, cap)
                else:
                    rho = 0.0 if rho > cap else rho
                term = term * rho
            if beta != 0.0:
                d = ref[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            row_sum = row_sum + term
        per_row_sums.append(row_sum)
        row_counts.append(n_i)
    total = sum(per_row_sums, torch.tensor(0.0, dtype=torch.float64))
    if loss_type in ("grpo", "sapo"):
        return sum(s / max(n, 1) for s, n in zip(per_row_sums, row_counts)) / B / ga
    if loss_type == "bnpo":
        return total / max(sum(row_counts), 1) / ga
    if loss_type == "dr_grpo":
        return total / (B * max_len) / ga
    if num_items is None:  # unknown window: the micro-batch's own tokens, times the accumulation steps
        return total / (max(sum(row_counts), 1) * ga)
    return total / (max(num_items, 1) / nproc)


# -- data ------------------------------------------------------------------------------------


def make_batch(seed: int = 0, B: int = 4, T: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0  # shorter completion
    mask[2, 1:] = 0  # single-token completion
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    pad = ~mask.bool()
    # Padding holds garbage; none of it may reach the loss or its gradient.
    logp[pad], old[pad], ref[pad], sampling[pad] = float("nan"), float("-inf"), float("inf"), float("nan")
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1][:B], dtype=torch.float64)
    return {"logp": logp, "old": old, "ref": ref, "sampling": sampling, "adv": adv, "mask": mask}


def run_ours(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, LossMetrics]:
    logp = batch["logp"].clone().requires_grad_(True)
    loss, metrics = compute_loss(
        logp,
        batch["old"],
        batch["adv"],
        batch["mask"],
        ref_per_token_logps=batch["ref"],
        sampling_per_token_logps=batch["sampling"],
        **kw,
    )
    loss.backward()
    return loss.detach(), logp.grad, metrics


def run_reference(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    logp = batch["logp"].clone().requires_grad_(True)
    loss = reference_loss(
        logp, batch["old"], batch["adv"].tolist(), batch["mask"].tolist(),
        ref=batch["ref"], sampling=batch["sampling"], **kw,
    )
    loss.backward()
    grad = logp.grad if logp.grad is not None else torch.zeros_like(logp)
    return loss.detach(), torch.nan_to_num(grad, nan=0.0)  # padding is never touched by the reference


def seed_for(loss_type: str, level: str) -> int:
    return 10 * LOSS_TYPES.index(loss_type) + LEVELS.index(level)


GRID = list(itertools.product(LOSS_TYPES, LEVELS, [None, 1.4], [0.0, 0.04], CORRECTIONS))


@pytest.mark.parametrize(("loss_type", "level", "delta", "beta", "correction"), GRID)
def test_loss_and_gradient_match_float64_reference(loss_type, level, delta, beta, correction):
    batch = make_batch(seed=seed_for(loss_type, level))
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    loss, grad, metrics = run_ours(
        batch,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon=EPS,
        epsilon_high=eps_high,
        delta=delta,
        beta=beta,
        max_completion_length=MAX_LEN,
        vllm_importance_sampling_correction=correction is not None,
        rollout_correction=correction or "token_truncate",
        vllm_importance_sampling_cap=CAP,
        num_items_in_batch=NUM_ITEMS,
        num_processes=NPROC,
        gradient_accumulation_steps=GA,
    )
    expected_loss, expected_grad = run_reference(
        batch, loss_type=loss_type, level=level, eps=EPS, eps_high=eps_high, delta=delta, beta=beta,
        correction=correction, cap=CAP, max_len=MAX_LEN, num_items=NUM_ITEMS, nproc=NPROC, ga=GA,
    )
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert not (grad[~batch["mask"].bool()] != 0).any(), "padding must get exactly zero gradient"
    assert all(math.isfinite(v) for v in metrics.values())


def test_the_grid_exercises_clipping_delta_and_truncation():
    """The reference grid is only meaningful if its data hits every branch."""
    b = make_batch(seed=seed_for("grpo", "token"))
    m = b["mask"].bool()
    ratio = (b["logp"] - b["old"]).exp()[m]
    assert (ratio < 1 - EPS).any() and (ratio > 1 + EPS_HIGH).any() and (ratio > 1.4).any()
    rho = (b["old"] - b["sampling"]).exp()[m]
    assert (rho > CAP).any() and (rho < CAP).any()


# -- hand-computed cases ---------------------------------------------------------------------


def _one(logp: list[list[float]], **kw) -> tuple[float, list[list[float]], LossMetrics]:
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    kw.setdefault("old_per_token_logps", None)
    old = kw.pop("old_per_token_logps")
    old = torch.tensor(old, dtype=torch.float64) if old is not None else None
    adv = torch.tensor(kw.pop("advantages"), dtype=torch.float64)
    mask = torch.tensor(kw.pop("mask", [[1] * len(logp[0])] * len(logp)))
    for key in ("ref_per_token_logps", "sampling_per_token_logps"):
        if key in kw:
            kw[key] = torch.tensor(kw[key], dtype=torch.float64)
    loss, metrics = compute_loss(lp, old, adv, mask, **kw)
    loss.backward()
    return loss.item(), lp.grad.tolist(), metrics


def test_on_policy_grpo_by_hand():
    # r = 1 everywhere, A = 2: per-token loss -2; grpo: mean of row means = -2;
    # d/dlogp of -r*A is -A*r = -2 per token, / T = 2 tokens -> -1 each.
    loss, grad, _ = _one([[-1.0, -2.0]], advantages=[2.0], loss_type="grpo")
    assert loss == pytest.approx(-2.0)
    assert grad == [[pytest.approx(-1.0), pytest.approx(-1.0)]]


def test_on_policy_dr_grpo_and_dapo_by_hand():
    # Token sum -4; dr_grpo divides by B * max_completion_length = 4, dapo by the 2 tokens.
    loss, grad, _ = _one([[-1.0, -2.0]], advantages=[2.0], loss_type="dr_grpo", max_completion_length=4)
    assert loss == pytest.approx(-1.0) and grad == [[pytest.approx(-0.5)] * 2]
    loss, grad, _ = _one([[-1.0, -2.0]], advantages=[2.0], loss_type="dapo")
    assert loss == pytest.approx(-2.0) and grad == [[pytest.approx(-1.0)] * 2]


def test_clipping_by_hand():
    # r = 1.5 > 1 + 0.2 with A = +1: the clipped branch wins, loss -1.2, no gradient.
    loss, grad, m = _one([[math.log(1.5)]], old_per_token_logps=[[0.0]], advantages=[1.0], loss_type="bnpo")
    assert loss == pytest.approx(-1.2) and grad == [[0.0]]
    assert m["clip_ratio/high_mean"] == 1.0 and m["clip_ratio/low_mean"] == 0.0
    # Same ratio with A = -1: the unclipped branch wins, loss 1.5, gradient -A*r = 1.5.
    loss, grad, m = _one([[math.log(1.5)]], old_per_token_logps=[[0.0]], advantages=[-1.0], loss_type="bnpo")
    assert loss == pytest.approx(1.5) and grad == [[pytest.approx(1.5)]]
    assert m["clip_ratio/region_mean"] == 0.0
    # r = 0.5 < 1 - 0.2 with A = -1: clipped at 0.8, loss 0.8, counted as low-clipped.
    loss, grad, m = _one([[math.log(0.5)]], old_per_token_logps=[[0.0]], advantages=[-1.0], loss_type="bnpo")
    assert loss == pytest.approx(0.8) and grad == [[0.0]] and m["clip_ratio/low_mean"] == 1.0


def test_epsilon_high_defaults_to_epsilon():
    loss, _, _ = _one([[math.log(1.5)]], old_per_token_logps=[[0.0]], advantages=[1.0], loss_type="bnpo", epsilon=0.3)
    assert loss == pytest.approx(-1.3)
    loss, _, _ = _one(
        [[math.log(1.5)]], old_per_token_logps=[[0.0]], advantages=[1.0], loss_type="bnpo", epsilon=0.3, epsilon_high=0.4
    )
    assert loss == pytest.approx(-1.4)


def test_delta_caps_the_unclipped_ratio_by_hand():
    # r = 3, A = -1: without delta the loss is 3 (gradient 3); delta = 2 caps it at 2 (gradient 0).
    loss, grad, _ = _one([[math.log(3.0)]], old_per_token_logps=[[0.0]], advantages=[-1.0], loss_type="bnpo")
    assert loss == pytest.approx(3.0) and grad == [[pytest.approx(3.0)]]
    loss, grad, _ = _one([[math.log(3.0)]], old_per_token_logps=[[0.0]], advantages=[-1.0], loss_type="bnpo", delta=2.0)
    assert loss == pytest.approx(2.0) and grad == [[0.0]]


def test_k3_kl_by_hand():
    # A = 0 leaves only beta * k3; ref - logp = ln 2: k3 = 2 - ln 2 - 1; d k3 / d logp = 1 - e^(ln 2) = -1.
    loss, grad, m = _one([[0.0]], advantages=[0.0], loss_type="bnpo", beta=0.5, ref_per_token_logps=[[math.log(2.0)]])
    assert loss == pytest.approx(0.5 * (1 - math.log(2.0)))
    assert grad == [[pytest.approx(-0.5)]]
    assert m["kl"] == pytest.approx(1 - math.log(2.0))


def test_truncated_importance_sampling_by_hand():
    # old - sampling = ln 4 -> rho = 4, truncated at the cap 2 (or dropped by the mask variant).
    common = dict(advantages=[1.0], loss_type="bnpo", sampling_per_token_logps=[[-math.log(4.0), 0.0]])
    loss, _, m = _one([[0.0, 0.0]], **common)  # auto: on, because sampling log-probs are given
    assert loss == pytest.approx(-(2.0 + 1.0) / 2)
    assert (m["sampling/importance_sampling_ratio/min"], m["sampling/importance_sampling_ratio/max"]) == (1.0, 2.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.5)
    loss, _, m = _one([[0.0, 0.0]], rollout_correction="token_mask", **common)
    assert loss == pytest.approx(-(0.0 + 1.0) / 2) and m["sampling/importance_sampling_ratio/min"] == 0.0
    loss, _, m = _one([[0.0, 0.0]], rollout_correction="sequence_truncate", **common)
    assert loss == pytest.approx(-2.0) and m["sampling/importance_sampling_ratio/mean"] == 2.0
    loss, _, _ = _one([[0.0, 0.0]], rollout_correction="sequence_mask", **common)
    assert loss == 0.0
    loss, _, m = _one([[0.0, 0.0]], vllm_importance_sampling_correction=False, **common)
    assert loss == pytest.approx(-1.0) and "sampling/importance_sampling_ratio/mean" not in m


def test_sequence_level_ratio_is_the_mean_token_log_ratio():
    # log-ratios 0.2 and 0.4 -> one ratio exp(0.3) for the sequence; A = -1 so unclipped: loss = exp(0.3).
    loss, grad, _ = _one(
        [[0.2, 0.4, 9.0]], old_per_token_logps=[[0.0, 0.0, 0.0]], advantages=[-1.0], mask=[[1, 1, 0]],
        loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.5,
    )
    assert loss == pytest.approx(math.exp(0.3))
    assert grad == [[pytest.approx(math.exp(0.3) / 2)] * 2 + [0.0]]


def test_cispo_and_sapo_by_hand():
    # cispo: -min(r, eps_high).detach() * A * logp with r = 1 (on-policy), eps_high 5: loss = -A*logp.
    loss, grad, _ = _one([[-0.5]], advantages=[2.0], loss_type="cispo", epsilon_high=5.0)
    assert loss == pytest.approx(1.0) and grad == [[pytest.approx(-2.0)]]
    # sapo at r = 1: sigma(0) * 4 / tau = 2 / tau; A > 0 uses tau = 1, A <= 0 uses tau = 1.05.
    loss, _, _ = _one([[-0.5]], advantages=[2.0], loss_type="sapo")
    assert loss == pytest.approx(-2.0 * 2.0)
    loss, _, _ = _one([[-0.5]], advantages=[-2.0], loss_type="sapo")
    assert loss == pytest.approx(2.0 * 2.0 / 1.05)
    loss, _, _ = _one([[-0.5]], advantages=[-2.0], loss_type={"name": "sapo", "params": {"temperature_neg": 2.0}})
    assert loss == pytest.approx(2.0 * 2.0 / 2.0)


def test_single_token_completion():
    # B = 2, row 1 has one active token: grpo averages row means, so that token weighs 1/2.
    loss, grad, _ = _one(
        [[-1.0, -1.0, -1.0], [-1.0, 5.0, 5.0]], advantages=[1.0, 3.0], mask=[[1, 1, 1], [1, 0, 0]], loss_type="grpo"
    )
    assert loss == pytest.approx((-1.0 + -3.0) / 2)
    assert grad == [[pytest.approx(-1 / 6)] * 3, [pytest.approx(-1.5), 0.0, 0.0]]


# -- NaN safety --------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("num_items", [None, 0])
def test_all_masked_batch_gives_zero_loss_zero_gradient_finite_metrics(loss_type, level, num_items):
    batch = make_batch()
    batch["mask"] = torch.zeros_like(batch["mask"])
    batch["logp"][0, 0] = float("inf")  # garbage everywhere, since everything is padding
    loss, grad, metrics = run_ours(
        batch, loss_type=loss_type, importance_sampling_level=level, beta=0.1, max_completion_length=MAX_LEN,
        vllm_importance_sampling_correction=True, num_items_in_batch=num_items, gradient_accumulation_steps=2,
    )
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert set(metrics) >= {"kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"}
    # Per-sequence values count every row, empty ones too (TRL's definition): an empty row's
    # ratio is 1, which is above cispo's cap ε_high = 0.2 here, so its clip ratio counts the
    # rows with A > 0 (tests/test_objective_trl_pieces.py checks that against TRL).
    per_sequence = {"cispo_clip_ratio"} if (loss_type, level) == ("cispo", "sequence") else set()
    assert all(v == 0.0 for k, v in metrics.items() if k not in per_sequence)
    for name in per_sequence:
        assert metrics[name] == pytest.approx(float((batch["adv"] > 0).float().mean()))


def test_float32_and_bfloat16_inputs_stay_finite():
    batch = make_batch()
    for dtype in (torch.float32, torch.bfloat16):
        b = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
        loss, grad, metrics = run_ours(b, beta=0.04)
        assert loss.dtype == dtype and torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(math.isfinite(v) for v in metrics.values())


# -- accumulation: the dapo normaliser is the whole window ---------------------------------------


def _window_batch(seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 5
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 3, 1])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T), uneven lengths
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return {"logp": logp, "old": old, "adv": adv, "mask": mask, "ref": ref}


def _grad(b: dict, rows: slice, leaf: torch.Tensor, **kw) -> None:
    loss, _ = compute_loss(
        leaf[rows], b["old"][rows], b["adv"][rows], b["mask"][rows], ref_per_token_logps=b["ref"][rows],
        beta=0.04, max_completion_length=5, **kw,
    )
    loss.backward()


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "dr_grpo", "grpo"])
def test_accumulated_micro_batches_equal_one_big_batch(loss_type):
    b = _window_batch()
    total_tokens = int(b["mask"].sum())
    big = b["logp"].clone().requires_grad_(True)
    _grad(b, slice(None), big, loss_type=loss_type, num_items_in_batch=total_tokens)

    accumulated = b["logp"].clone().requires_grad_(True)
    for k in range(4):  # four micro-batches of two rows, uneven token counts
        _grad(b, slice(2 * k, 2 * k + 2), accumulated, loss_type=loss_type,
              num_items_in_batch=total_tokens, gradient_accumulation_steps=4)
    torch.testing.assert_close(accumulated.grad, big.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_processes_times_micro_batches_equal_one_big_batch(loss_type):
    """2 processes x 2 micro-batches each; DDP averages the processes' gradients."""
    b = _window_batch(seed=5)
    total_tokens = int(b["mask"].sum())
    big = b["logp"].clone().requires_grad_(True)
    _grad(b, slice(None), big, loss_type=loss_type, num_items_in_batch=total_tokens)

    per_process = []
    for p in range(2):
        leaf = b["logp"].clone().requires_grad_(True)
        for k in range(2):
            start = 4 * p + 2 * k
            _grad(b, slice(start, start + 2), leaf, loss_type=loss_type, num_items_in_batch=total_tokens,
                  num_processes=2, gradient_accumulation_steps=2)
        per_process.append(leaf.grad)
    ddp_grad = (per_process[0] + per_process[1]) / 2
    torch.testing.assert_close(ddp_grad, big.grad, rtol=1e-12, atol=1e-14)


def test_dapo_normaliser_is_the_window_token_count():
    b = _window_batch()
    rows = slice(0, 2)  # 6 active tokens in this micro-batch
    loss_window, _ = compute_loss(b["logp"][rows], b["old"][rows], b["adv"][rows], b["mask"][rows],
                                  loss_type="dapo", num_items_in_batch=24, num_processes=2)
    loss_local, _ = compute_loss(b["logp"][rows], b["old"][rows], b["adv"][rows], b["mask"][rows], loss_type="dapo")
    # local normaliser 6; window normaliser 24 / 2 processes = 12
    torch.testing.assert_close(loss_window, loss_local * 6 / 12)


def test_nan_sampler_logprob_counts_as_no_mismatch():
    # Token 0: old - sampling = ln 1.5 -> rho 1.5; token 1: sampler gave NaN -> rho 1.
    loss, _, m = _one([[0.0, 0.0]], advantages=[1.0], loss_type="bnpo",
                      sampling_per_token_logps=[[-math.log(1.5), float("nan")]])
    assert loss == pytest.approx(-(1.5 + 1.0) / 2)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5)


def test_bnpo_normalises_each_micro_batch_by_its_own_tokens():
    """Unlike dapo, bnpo's accumulated gradient differs from one big batch when micro-batches
    hold different numbers of tokens (TRL's definition: local normalisation)."""
    b = _window_batch()
    big = b["logp"].clone().requires_grad_(True)
    _grad(b, slice(None), big, loss_type="bnpo")
    accumulated = b["logp"].clone().requires_grad_(True)
    for k in range(4):
        _grad(b, slice(2 * k, 2 * k + 2), accumulated, loss_type="bnpo", gradient_accumulation_steps=4)
    assert not torch.allclose(accumulated.grad, big.grad)
    # Each micro-batch's tokens are weighted by 1 / (4 * its own token count).
    tokens = b["mask"].sum(-1).view(4, 2).sum(-1).double()  # (4,) tokens per micro-batch
    ratio = (accumulated.grad / big.grad).nan_to_num(nan=0.0)
    for k in range(4):
        active = b["mask"][2 * k : 2 * k + 2].bool()
        expected = b["mask"].sum().item() / (4 * tokens[k].item())
        torch.testing.assert_close(ratio[2 * k : 2 * k + 2][active], torch.full((int(active.sum()),), expected, dtype=torch.float64))
