"""The training and log-prob passes never use cuDNN's fused attention (issue 12, item 1).

On H100/H200 with torch 2.11, cuDNN's attention backward returns NaN query gradients for
sequence lengths of 64 mod 128 when a query row is fully masked (left padding): the GPU
example's non-finite LoRA gradient (bench/check_sdpa_nan.py reproduces it on the GPU). The fix
switches that backend off around every training forward, its backward (where activation
checkpointing recomputes the layers) and the log-prob pass. On a CPU the backend does not run,
so this test checks the switch itself: every attention call of those passes, including the
recomputed ones inside backward, sees cuDNN attention disabled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.attention import TRAINING_SDPA_BACKENDS, training_attention
from grpo_plugins.engine import Engine

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def test_training_attention_switches_off_cudnn_only() -> None:
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with training_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in TRAINING_SDPA_BACKENDS


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
def test_training_and_logprob_passes_run_without_cudnn_attention(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora: dict | None
) -> None:
    original = torch.nn.functional.scaled_dot_product_attention
    calls: list[dict[str, bool]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append({
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "grad": torch.is_grad_enabled(),
            "in_backward": torch._C._current_graph_task_id() != -1,
        })
        return original(*args, **kwargs)

    cfg = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 2,
        "per_device_train_batch_size": 8, "num_generations": 4, "steps_per_generation": 2,
        "max_completion_length": 6, "learning_rate": 1e-3, "report_to": [], "seed": 0,
        "gradient_checkpointing": True, "lora": lora, "compile_layers": False,
    }
    import grpo_plugins.run_parts as run_parts

    build = run_parts.build_generator

    def build_unrecorded(*args: Any, **kwargs: Any) -> Any:
        # Only the training and log-prob passes are recorded: generation is forward-only.
        generator = build(*args, **kwargs)
        generator.generate = _unrecorded(generator.generate, original)
        return generator

    monkeypatch.setattr(run_parts, "build_generator", build_unrecorded)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    engine = Engine(cfg, rewards=[char_sum], dataset=PROMPTS)
    engine.train()

    assert calls, "the tiny model's attention never went through scaled_dot_product_attention"
    assert any(c["in_backward"] for c in calls)  # activation checkpointing's recomputation
    assert any(not c["grad"] for c in calls)  # the old-log-prob pass (no grad)
    assert any(c["grad"] and not c["in_backward"] for c in calls)  # the training forward
    assert not any(c["cudnn"] for c in calls), [c for c in calls if c["cudnn"]]


def _unrecorded(generate: Any, original: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        patched = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = original
        try:
            return generate(*args, **kwargs)
        finally:
            torch.nn.functional.scaled_dot_product_attention = patched

    return run
