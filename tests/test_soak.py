"""A short soak: 200 optimizer steps of a tiny model on CPU with rewards that randomly raise,
return None, return garbage or time out (all configured ``on_error: none``). The run completes,
every logged metric is finite, and the resident memory does not grow step over step."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

STEPS = 200
TIMEOUT = 0.1
PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"]]

#: What the flaky rewards did, and the process's RSS (bytes) at each scoring of a batch.
OUTCOMES: Counter[str] = Counter()
RSS: list[int] = []
_rng = random.Random(1234)  # the rewards' own luck, independent of the run's seeded RNGs


def resident_bytes() -> int:
    """Resident set size of this process, from /proc (no psutil)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def flaky(completions: list[str], **kwargs: Any) -> list[Any]:
    """Scores length, but 10% of calls raise, 5% hang past the timeout, 10% return None for
    everything, and single samples are None or not a number."""
    if len(completions) > 1:  # the batch call of a step, not a per-sample retry after a failure
        RSS.append(resident_bytes())
    roll = _rng.random()
    if roll < 0.10:
        OUTCOMES["raise"] += 1
        raise RuntimeError("flaky reward failed")
    if roll < 0.15:
        OUTCOMES["timeout"] += 1
        time.sleep(TIMEOUT * 2.5)
        return [1.0] * len(completions)
    if roll < 0.25:
        OUTCOMES["none"] += 1
        return [None] * len(completions)
    out: list[Any] = [float(len(c)) for c in completions]
    if roll < 0.40:
        OUTCOMES["bad sample"] += 1
        out[0] = None
        out[-1] = "not a number"
    else:
        OUTCOMES["ok"] += 1
    return out


async def flaky_async(completions: list[str], **kwargs: Any) -> list[float]:
    """An async reward that sometimes raises or hangs past the timeout."""
    roll = _rng.random()
    if roll < 0.08:
        OUTCOMES["async raise"] += 1
        raise ValueError("async reward failed")
    if roll < 0.13:
        OUTCOMES["async timeout"] += 1
        await asyncio.sleep(TIMEOUT * 5)
    return [float(sum(map(ord, c)) % 5) for c in completions]


def _slope(values: list[float]) -> float:
    """Least-squares slope of values against their index."""
    n = len(values)
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


@pytest.mark.slow
def test_soak_flaky_rewards_200_steps(tiny_model: dict, tmp_path: Path) -> None:
    import torch

    from grpo_plugins.engine import Engine
    from grpo_plugins.metrics import read_metrics

    OUTCOMES.clear()
    RSS.clear()
    reward = {"on_error": "none", "timeout": TIMEOUT}
    config = {
        "model": tiny_model,
        "task": None,
        "rewards": [{"name": "test_soak:flaky", **reward}, {"name": "test_soak:flaky_async", **reward}],
        "output_dir": str(tmp_path / "out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "num_generations": 4,
        "max_completion_length": 4,
        "learning_rate": 1e-3,
        "logging_steps": 10,
        "save_steps": 100,
        "save_total_limit": 1,
        "report_to": ["jsonl", "tensorboard"],
        "seed": 7,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from more; on a busy machine they spin
    try:
        started = time.monotonic()
        result = Engine(config, dataset=PROMPTS).train()
        elapsed = time.monotonic() - started
    finally:
        torch.set_num_threads(threads)

    assert result.global_step == STEPS
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == [f"checkpoint-{STEPS}"]
    for outcome in ("raise", "timeout", "none", "bad sample", "ok", "async raise", "async timeout"):
        assert OUTCOMES[outcome] > 0, (outcome, OUTCOMES)

    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == list(range(10, STEPS + 1, 10))
    for record in records:
        for key, value in record.items():
            assert math.isfinite(value), (record["step"], key, value)
    assert all(r["nonfinite_skipped"] == 0.0 for r in records)

    # One RSS sample per step; after the first half (warm-up, allocator pools), the trend must be
    # flat: under 20 KiB per step (2 MiB over the last 100 steps).
    assert len(RSS) == STEPS
    second_half = [b / 2**10 for b in RSS[STEPS // 2 :]]
    slope = _slope(second_half)
    print(f"soak: {elapsed:.0f} s, RSS {RSS[0] / 2**20:.0f} -> {RSS[-1] / 2**20:.0f} MiB, {slope:.2f} KiB/step late")
    assert slope < 20.0, f"RSS grows {slope:.1f} KiB/step over the last {STEPS // 2} steps ({elapsed:.0f} s run)"
