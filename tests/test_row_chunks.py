"""train_chunk_rows: a micro-step run as row chunks gives the whole micro-batch's gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.config import GRPOConfig
from grpo_plugins.engine import Engine
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.metrics import read_metrics
from grpo_plugins.models import load_model
from grpo_plugins.objective import LossMetrics, compute_loss
from grpo_plugins.registry import get_registry
from grpo_plugins.row_chunks import ChunkedReduction, row_chunks

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def test_row_chunks_cover_the_rows_in_order() -> None:
    assert row_chunks(8, None) == [slice(0, 8)]
    assert row_chunks(8, 8) == [slice(0, 8)]
    assert row_chunks(8, 20) == [slice(0, 8)]
    assert row_chunks(8, 3) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert row_chunks(1, 1) == [slice(0, 1)]


def test_train_chunk_rows_must_be_positive() -> None:
    with pytest.raises((GRPOPluginsError, ValueError), match="train_chunk_rows"):
        GRPOConfig.model_validate({"train_chunk_rows": 0})
    assert GRPOConfig.model_validate({"train_chunk_rows": 4}).train_chunk_rows == 4
    assert GRPOConfig.model_validate({}).train_chunk_rows is None


# -- compute_loss level: every registered loss type, all objective features on ---------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", get_registry().names("loss_type"))
def test_chunked_reduction_matches_the_whole_batch(loss_type: str, level: str) -> None:
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 7
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[3] = 0.0  # an all-masked row
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logps = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    sampling = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    registry = get_registry()
    settings: dict[str, Any] = dict(
        loss_type=registry.build("loss_type", loss_type),
        importance_sampling_level=level,
        beta=0.05,
        max_completion_length=T,
        vllm_importance_sampling_correction=True,
        num_items_in_batch=mask.sum() * 2 + 5,  # as if other micro-batches share the window
        gradient_accumulation_steps=2,
        num_processes=1,
    )

    def loss(rows: slice, chunked: bool) -> tuple[torch.Tensor, LossMetrics]:
        s = dict(settings)
        if chunked:
            s["loss_type"] = ChunkedReduction(s["loss_type"], mask, advantages, rows)
        return compute_loss(
            logps[rows], old[rows], advantages[rows], mask[rows],
            ref_per_token_logps=ref[rows], sampling_per_token_logps=sampling[rows], **s,
        )

    whole, whole_metrics = loss(slice(0, B), chunked=False)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    parts = [loss(c, chunked=True) for c in row_chunks(B, 3)]
    total = sum(p[0] for p in parts)
    (chunked_grad,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=1e-12, atol=1e-12)
    assert whole_grad.abs().sum() > 0
    merged = LossMetrics.merge(p[1] for p in parts)
    # Metrics are kept in float32: the chunks' partial sums add up to the whole's to float32
    # rounding (the sampler log-prob gap, a sum of many small values, shows it).
    assert dict(merged) == pytest.approx(dict(whole_metrics), rel=1e-6, abs=1e-12)


# -- the engine: one run chunked, one not, same parameters and logs ------------------------------


class _GradEngine(Engine):
    """Keeps a copy of the accumulated gradient of each optimizer step."""

    def _optimizer_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.grads.append([p.grad.detach().clone() for p in self.trainable])
        return super()._optimizer_step(*args, **kwargs)


def _train(
    tiny_model: dict, tmp_path: Path, chunk: int | None, settings: dict[str, Any]
) -> tuple[Any, list, list, list]:
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    seen: list[int] = []  # rows of every forward that builds a graph (the training forwards)

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            seen.append(int(kwargs["input_ids"].shape[0]))

    model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    cfg = {
        "model": tiny_model,
        "task": None,
        "output_dir": str(tmp_path / f"out-{chunk}"),
        "max_steps": 2,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,  # the second step is off-policy: old log-probs are used
        "num_generations": 4,
        "max_completion_length": 6,
        # AdamW's first steps move every weight by about lr whatever its gradient's size, so fp32
        # rounding in tiny gradients shows in the weights at ~1e-4 x lr.
        "learning_rate": 1e-3,
        "report_to": ["jsonl"],
        "seed": 0,
        "train_chunk_rows": chunk,
        **settings,
    }
    engine = _GradEngine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    engine.grads = []
    engine.train()
    return model, read_metrics(tmp_path / f"out-{chunk}"), seen, engine.grads


@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "dapo"},
        {"loss_type": "grpo"},
        {"loss_type": "dr_grpo"},
        {"loss_type": "bnpo"},
        {"loss_type": "sapo"},
        {"loss_type": "cispo"},
        {"loss_type": "dapo", "importance_sampling_level": "sequence"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "grpo", "beta": 0.1, "vllm_importance_sampling_correction": True},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_chunked_training_step_equals_the_whole_micro_batch(tiny_model: dict, tmp_path: Path, settings: dict) -> None:
    before, _ = load_model(tiny_model, dtype="float32", seed=0)
    whole, whole_log, whole_seen, whole_grads = _train(tiny_model, tmp_path, None, settings)
    chunked, chunked_log, chunked_seen, chunked_grads = _train(tiny_model, tmp_path, 2, settings)

    assert whole_seen == [8, 8]  # one forward of the whole micro-batch per step
    assert chunked_seen == [2] * 8  # four chunks of two rows per step

    for step_whole, step_chunked in zip(whole_grads, chunked_grads, strict=True):
        scale = max(g.abs().max().item() for g in step_whole)
        assert scale > 0
        for a, b in zip(step_whole, step_chunked, strict=True):
            # fp32 sums in another order: a few ulps of the largest entry (seen: 1.03e-6 x scale)
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale)
    moved = max((a - b).abs().max().item() for a, b in zip(before.parameters(), whole.parameters(), strict=True))
    assert moved > 1e-4
    worst = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(whole.parameters(), chunked.parameters(), strict=True)
    )
    assert worst <= 1e-6, worst
    assert [r["step"] for r in chunked_log] == [1, 2]
    skip = {"timing/", "tokens_per_second", "peak_memory_gb"}
    for w, c in zip(whole_log, chunked_log, strict=True):
        assert w.keys() == c.keys()
        for key in w:
            if any(key.startswith(s) for s in skip):
                continue
            assert c[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
    assert any(w["grad_norm"] > 0 for w in whole_log)


@pytest.mark.slow
def test_two_processes_with_chunks_match_one_without(tiny_model: dict, one_process_run: Path, tmp_path: Path) -> None:
    """DDP: only the last chunk of a window's last micro-step syncs; the result is unchanged.
    The one process (test_distributed's config, no chunks) is ``one_process_run`` (conftest.py)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    import test_distributed as dist

    one, two = one_process_run, tmp_path / "two"
    (tmp_path / "two.json").write_text(json.dumps({**dist._config(tiny_model, two, per_device=4), "train_chunk_rows": 3}))
    script = dist.__file__
    run = subprocess.run([*dist.LAUNCHERS["torchrun"], script, str(tmp_path / "two.json")], env=dist._env(), capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    w1 = load_file(str(one / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-5)
    m1, m2 = read_metrics(one), read_metrics(two)
    assert len(m1) == len(m2) == 4
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key
