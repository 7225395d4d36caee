"""group_by_length: a micro-step's rows sorted by length, split where padding is saved, each
pass cut to its own longest row; the loss and gradient stay the whole micro-batch's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.engine import Engine
from grpo_plugins.models import load_model
from grpo_plugins.objective import LossMetrics, compute_loss
from grpo_plugins.registry import get_registry
from grpo_plugins.row_chunks import ChunkedReduction, length_chunks
from grpo_plugins.testing import ScriptedGenerator, registered_component


def _median_300_of_1024(rows: int, seed: int = 0) -> list[int]:
    """Completion lengths with a long tail: median about 300, a few rows at the 1024 cap."""
    rng = random.Random(seed)
    return [min(1024, max(8, int(rng.lognormvariate(5.7, 0.6)))) for _ in range(rows)]


def _cost(prompts: list[int], completions: list[int], order: list[int], chunks: list[slice]) -> int:
    """Tokens the passes process: each chunk's rows x its longest prompt + longest completion."""
    total = 0
    for c in chunks:
        rows = order[c]
        total += len(rows) * (max(prompts[i] for i in rows) + max(completions[i] for i in rows))
    return total


def test_equal_lengths_stay_one_pass_in_their_order() -> None:
    assert length_chunks([5] * 8, [40] * 8, None, split=True) == (list(range(8)), [slice(0, 8)])
    assert length_chunks([5] * 8, [40] * 8, None, split=False) == (list(range(8)), [slice(0, 8)])


def test_varied_lengths_cost_about_their_real_tokens() -> None:
    completions = _median_300_of_1024(64)
    prompts = [60] * 64
    real = sum(p + c for p, c in zip(prompts, completions))
    padded = 64 * (60 + max(completions))
    order, chunks = length_chunks(prompts, completions, None, split=True)
    assert sorted(order) == list(range(64))
    assert [completions[i] for i in order] == sorted(completions, reverse=True)
    assert [c.start for c in chunks][1:] == [c.stop for c in chunks][:-1] and chunks[-1].stop == 64
    assert all(c.stop - c.start >= 2 for c in chunks)
    cost = _cost(prompts, completions, order, chunks)
    assert cost <= 1.15 * real  # within 15 % of the real tokens ...
    assert cost <= 0.45 * padded  # ... and under half of the padded micro-batch
    assert 2 <= len(chunks) <= 12


def test_passes_below_the_host_bound_size_are_not_worth_a_split() -> None:
    """On a GPU a pass smaller than ``min_pass_tokens`` costs as much as that many tokens (the
    host launching its kernels sets its time): a small model's micro-batch stays one pass, a
    large model's is still split where the split saves more than a host-bound pass costs."""
    completions = _median_300_of_1024(64)
    prompts = [60] * 64
    padded = 64 * (60 + max(completions))
    free = length_chunks(prompts, completions, None, split=True)[1]
    small_model = length_chunks(prompts, completions, None, split=True, min_pass_tokens=150_000)[1]
    assert small_model == [slice(0, 64)] and len(free) > 1
    half = length_chunks(prompts, completions, None, split=True, min_pass_tokens=padded // 3)[1]
    assert 1 < len(half) < len(free)
    # A host-bound pass size far below the passes the split makes changes nothing (7B: ~2.5k).
    assert length_chunks(prompts, completions, None, split=True, min_pass_tokens=500)[1] == free


def test_host_bound_tokens_follow_the_model_size_on_cuda_only(tiny_model: dict) -> None:
    from grpo_plugins.policy import host_bound_tokens

    model, _ = load_model(tiny_model, dtype="float32", seed=0)
    assert host_bound_tokens(model, torch.device("cpu")) == 0
    tiny = host_bound_tokens(model, torch.device("cuda"))  # no CUDA needed: it only reads sizes
    params = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    assert tiny == int(layers * 0.01 * 4e14 / (6 * params)) and tiny > 10**6


def test_train_pass_tokens_caps_every_pass_and_lets_short_rows_share_one() -> None:
    completions = _median_300_of_1024(64)
    prompts = [60] * 64
    cap = 4 * (60 + 1024)  # four rows of the longest length
    order, chunks = length_chunks(prompts, completions, None, split=True, max_pass_tokens=cap)
    assert sorted(order) == list(range(64))
    assert chunks[0].start == 0 and chunks[-1].stop == 64
    assert [c.start for c in chunks][1:] == [c.stop for c in chunks][:-1]
    widths = [max(prompts[i] + completions[i] for i in order[c]) for c in chunks]
    for c, width in zip(chunks, widths):
        rows = c.stop - c.start
        assert rows * width <= cap or rows <= 3
    assert max(c.stop - c.start for c in chunks) > 4  # short rows: more of them in one pass
    # No cap, a cap above the whole micro-batch: the same plan.
    free = length_chunks(prompts, completions, None, split=True)
    assert length_chunks(prompts, completions, None, split=True, max_pass_tokens=64 * 1084) == free
    # Without splitting by length: as many rows a pass as the longest rows fit, at least one.
    assert length_chunks(prompts, completions, None, split=False, max_pass_tokens=cap)[1] == [
        slice(i, min(i + 4, 64)) for i in range(0, 64, 4)
    ]
    assert length_chunks(prompts, completions, 2, split=False, max_pass_tokens=cap)[1][0] == slice(0, 2)
    assert length_chunks(prompts, completions, None, split=False, max_pass_tokens=10)[1][:2] == [slice(0, 1), slice(1, 2)]


@pytest.mark.parametrize("rows", [2, 3, 5, 7])
def test_a_cap_below_two_rows_still_covers_every_row(rows: int) -> None:
    order, chunks = length_chunks([4] * rows, [96] * rows, None, split=True, max_pass_tokens=150)
    assert chunks[0].start == 0 and chunks[-1].stop == rows
    assert [c.start for c in chunks][1:] == [c.stop for c in chunks][:-1]
    assert all(2 <= c.stop - c.start <= 3 for c in chunks)


def test_train_chunk_rows_caps_every_pass() -> None:
    completions = _median_300_of_1024(32, seed=1)
    order, chunks = length_chunks([10] * 32, completions, 5, split=True)
    assert all(2 <= c.stop - c.start <= 5 for c in chunks)
    order, chunks = length_chunks([10] * 32, completions, 5, split=False)
    assert [c.stop - c.start for c in chunks] == [5] * 6 + [2]
    assert [completions[i] for i in order] == sorted(completions, reverse=True)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", get_registry().names("loss_type"))
def test_narrower_chunks_reduce_to_the_whole_batch(loss_type: str, level: str) -> None:
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 9
    lengths = [9, 8, 8, 6, 5, 3, 2, 0]  # sorted, longest first; the last row is empty
    mask = torch.zeros(B, T, dtype=torch.float64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1.0
    mask[2, 1] = 0.0  # a masked token inside a row
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logps = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    sampling = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    settings: dict[str, Any] = dict(
        importance_sampling_level=level, beta=0.05, max_completion_length=T,
        vllm_importance_sampling_correction=True, num_items_in_batch=mask.sum() * 2 + 5,
        gradient_accumulation_steps=2, num_processes=1,
    )
    inner = get_registry().build("loss_type", loss_type)
    whole, whole_metrics = compute_loss(
        logps, old, advantages, mask, ref_per_token_logps=ref, sampling_per_token_logps=sampling,
        loss_type=inner, **settings,
    )
    (whole_grad,) = torch.autograd.grad(whole, logps)
    parts = []
    for rows, width in ((slice(0, 3), 9), (slice(3, 5), 6), (slice(5, 8), 3)):
        parts.append(compute_loss(
            logps[rows, :width], old[rows, :width], advantages[rows], mask[rows, :width],
            ref_per_token_logps=ref[rows, :width], sampling_per_token_logps=sampling[rows, :width],
            loss_type=ChunkedReduction(inner, mask, advantages, rows), **settings,
        ))
    total = sum(p[0] for p in parts)
    (chunked_grad,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=1e-12, atol=1e-12)
    assert whole_grad.abs().sum() > 0
    merged = LossMetrics.merge(p[1] for p in parts)
    # Metrics are summed in float32 over other row sets: equal to float32 rounding.
    assert dict(merged) == pytest.approx(dict(whole_metrics), rel=1e-6, abs=1e-7)


# -- the engine: completions of very different lengths, grouped or not ---------------------------

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]


def _reply(prompt: str) -> str:
    """Four completions per prompt of 1 to ~30 characters, different for each prompt."""
    _reply.count += 1  # type: ignore[attr-defined]
    return "xyz" * (1 + (_reply.count * 7) % 10)  # type: ignore[attr-defined]


def _score(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(c) % 5) for c in completions]


class _GradEngine(Engine):
    def _optimizer_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.grads.append([p.grad.detach().clone() for p in self.trainable])
        return super()._optimizer_step(*args, **kwargs)


def _train(tiny_model: dict, tmp_path: Path, grouped: bool, **extra: Any) -> tuple[list, list[tuple[int, int]]]:
    _reply.count = 0  # type: ignore[attr-defined]
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    shapes: list[tuple[int, int]] = []  # (rows, columns) of every forward that builds a graph

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            shapes.append(tuple(kwargs["input_ids"].shape))

    model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)

    class Scripted(ScriptedGenerator):
        def __init__(self) -> None:
            super().__init__(_reply)

    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / f"out-{grouped}-{len(extra)}"),
        "max_steps": 2, "per_device_train_batch_size": 16, "num_generations": 4,
        "max_completion_length": 40, "learning_rate": 1e-3, "report_to": [], "seed": 0,
        "generator": "lengths", "group_by_length": grouped, **extra,
    }
    with registered_component("generator", Scripted, "lengths"):
        engine = _GradEngine(config, model=model, tokenizer=tok, rewards=[_score], dataset=PROMPTS)
        engine.grads = []
        engine.train()
    return engine.grads, shapes


def test_grouped_passes_are_narrower_and_give_the_same_gradient(tiny_model: dict, tmp_path: Path) -> None:
    whole_grads, whole_shapes = _train(tiny_model, tmp_path, grouped=False)
    grouped_grads, grouped_shapes = _train(tiny_model, tmp_path, grouped=True)
    assert [rows for rows, _ in whole_shapes] == [16, 16]  # one pass per step
    assert len(grouped_shapes) > 2  # split ...
    for step in range(2):  # ... into passes that process fewer tokens in all
        whole_tokens = whole_shapes[step][0] * whole_shapes[step][1]
        assert sum(r * c for r, c in grouped_shapes) < 2 * whole_tokens * 0.9
    for step_whole, step_grouped in zip(whole_grads, grouped_grads, strict=True):
        scale = max(g.abs().max().item() for g in step_whole)
        assert scale > 0
        for a, b in zip(step_whole, step_grouped, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale)


def test_train_pass_tokens_bounds_the_passes_and_keeps_the_gradient(tiny_model: dict, tmp_path: Path) -> None:
    """Without grouping (which on a CPU already makes passes of 2-3 rows here) the cap alone
    splits each 16-row micro-step; the unit tests above show it bounding grouped passes."""
    whole_grads, whole_shapes = _train(tiny_model, tmp_path, grouped=False)
    capped_grads, capped_shapes = _train(tiny_model, tmp_path, grouped=False, train_pass_tokens=160)
    assert [rows for rows, _ in whole_shapes] == [16, 16] and whole_shapes[0][1] * 16 > 160
    assert len(capped_shapes) > 2 * 2  # several passes per step ...
    assert all(rows * columns <= 160 for rows, columns in capped_shapes), capped_shapes  # ... each within the cap
    for step_whole, step_capped in zip(whole_grads, capped_grads, strict=True):
        scale = max(g.abs().max().item() for g in step_whole)
        assert scale > 0
        for a, b in zip(step_whole, step_capped, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale)


def test_the_first_step_of_a_cycle_sees_its_old_log_probs_exactly(tiny_model: dict, tmp_path: Path, monkeypatch: Any) -> None:
    # The old log-prob pass makes the training step's own passes (same rows together, same
    # padding), so before the first update of a cycle the ratio is exactly 1, grouped or not.
    import grpo_plugins.objective as objective

    _reply.count = 0  # type: ignore[attr-defined]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = objective.compute_loss

    def recording(per_token_logps: Any, old: Any, advantages: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((per_token_logps.detach().clone(), None if old is None else old.clone(), mask.clone()))
        return original(per_token_logps, old, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(objective, "compute_loss", recording)
    model, tok = load_model(tiny_model, dtype="float32", seed=0)

    class Scripted(ScriptedGenerator):
        def __init__(self) -> None:
            super().__init__(_reply)

    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 2,
        "per_device_train_batch_size": 16, "steps_per_generation": 2, "num_generations": 4,
        "max_completion_length": 40, "learning_rate": 1e-3, "report_to": [], "seed": 0, "generator": "lengths",
    }
    with registered_component("generator", Scripted, "lengths"):
        Engine(config, model=model, tokenizer=tok, rewards=[_score], dataset=PROMPTS * 2).train()
    # Step 1 (one micro-batch of the cycle's two) runs before any update: its passes ...
    first_cycle = [s for s in seen[: len(seen) // 2]]
    assert len(first_cycle) > 1  # ... are several, grouped by length
    for logps, old, mask in first_cycle:
        assert old is not None and logps.shape == old.shape
        active = mask != 0
        assert torch.equal(logps[active], old[active])


def test_passes_are_cut_from_the_row_layout_exactly_as_trim_padding_cuts_them() -> None:
    """pass_inputs cuts each pass from per-row counts read once per micro-batch; it must cut
    exactly what trim_padding (which asks the device) cuts, for every layout: left-padded
    prompts, right-padded completions, rows without a prompt token, and rows with holes."""
    from grpo_plugins.logprobs import left_aligned
    from grpo_plugins.policy import plan_passes, trim_padding

    gen = torch.Generator().manual_seed(0)
    P, T, B = 7, 9, 12
    for trial in range(20):
        att = torch.zeros(B, P + T, dtype=torch.long)
        for b in range(B):
            p = int(torch.randint(0, P + 1, (), generator=gen))
            c = int(torch.randint(0, T + 1, (), generator=gen))
            att[b, P - p : P + c] = 1
            if trial % 4 == 3 and b % 5 == 0 and p > 1:  # a hole inside the prompt
                att[b, P - 1] = 0
        ids = torch.randint(1, 50, (B, P + T), generator=gen) * att
        for chunk_rows, split in ((None, True), (3, False), (4, True), (1, False)):
            passes = plan_passes(ids, att, T, 4, chunk_rows, split=split)
            for c in passes.chunks:
                got = passes.pass_inputs(c, 4)
                if len(passes.chunks) == 1:
                    continue
                want = trim_padding(passes.ids[c], passes.attention_mask[c], passes.t, 4, min_t=min(2, passes.t))
                assert got[2] == want[2] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                # The layout's verdict on moving rows to their start is the device check's.
                checked = left_aligned(got[0], got[1], got[2]) is not None
                assert passes.one_run(c) == checked, (trial, chunk_rows, c)


def test_a_micro_step_synchronises_with_the_device_no_more_for_more_passes(tiny_model: dict, tmp_path: Path, monkeypatch: Any) -> None:
    """Every pass of a micro-step is planned from what one read of the device told: a host
    synchronisation inside the loop over passes would drain the GPU's queue before each pass.
    On the CPU there is nothing to drain, so the operations that would synchronise are counted:
    reads of device values, and tensors made from host data (``lift_fresh``: ``torch.tensor``,
    ``as_tensor``, ``new_tensor``), whose copy to a GPU waits for its queue."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import grpo_plugins.update as update

    syncing = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "equal", "lift_fresh"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func.__name__.split(".")[0] in syncing:
                counts[-1] += 1
            return func(*args, **(kwargs or {}))

    micro_step = update.PolicyUpdate.micro_step

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts.append(0)
        with Count():
            return micro_step(self, *args, **kwargs)

    plan_passes = update.plan_passes

    def planned(*args: Any, **kwargs: Any) -> Any:
        passes = plan_passes(*args, **kwargs)
        reordered[-1] = passes.order is not None  # the pass order's row index, copied without waiting
        return passes

    monkeypatch.setattr(update.PolicyUpdate, "micro_step", counted)
    monkeypatch.setattr(update, "plan_passes", planned)
    counts: list[int] = []
    reordered = [False]
    _, whole_shapes = _train(tiny_model, tmp_path, grouped=False)
    whole = counts
    counts = []
    reordered = [False]
    _, grouped_shapes = _train(tiny_model, tmp_path, grouped=True)
    assert len(whole_shapes) == 2 and len(grouped_shapes) > 4  # one pass per micro-step; several
    assert reordered[-1]
    assert [n - 1 for n in counts] == whole and max(whole) <= 3, (counts, whole)
