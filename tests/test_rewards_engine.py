"""Rewards named in a run config (built-ins, an import path, a process worker, on_error: none)
drive a real training run of a tiny model on the arithmetic task."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from grpo_plugins.engine import Engine
from grpo_plugins.metrics import read_metrics


def digit_count(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Module level, so it can run in a worker process; reads the task's ``answer`` column."""
    return [float(sum(ch.isdigit() for ch in c[0]["content"])) + 0 * len(a) for c, a in zip(completions, answer)]


def always_fails(completions: list[Any], **kwargs: Any) -> list[float]:
    raise RuntimeError("never works")


@pytest.mark.slow
def test_config_named_rewards_train_on_the_arithmetic_task(tiny_model: dict, tmp_path: Path) -> None:
    cfg = {
        "model": tiny_model,
        "task": {"name": "arithmetic", "params": {"num_samples": 16, "style": "expression"}},
        "rewards": [
            "correct_answer",
            {"name": "format", "weight": 0.5},
            {"name": f"{__name__}:digit_count", "executor": "process", "timeout": 60},
            {"name": f"{__name__}:always_fails", "on_error": "none"},
        ],
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "steps_per_generation": 2,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_prompt_length": 512,
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "seed": 0,
    }
    Engine(cfg).train()
    records = read_metrics(tmp_path / "out")
    assert records
    first = records[0]
    for name in ("correct_answer", "format", "digit_count"):
        assert math.isfinite(first[f"rewards/{name}/mean"])
    # A tiny random model writes no correct answers; the failing reward scores None everywhere
    # and is skipped, so the run goes on (it still has its metric column).
    assert first["rewards/correct_answer/mean"] == 0.0
    assert math.isfinite(first["reward"]) and "rewards/always_fails/mean" in first
    assert [r["step"] for r in records] == [1, 2]
