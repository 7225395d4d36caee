"""Kill -9 at the worst moments, then --resume: the run continues from the last complete
checkpoint and ends with exactly the parameters and metrics of an uninterrupted run (CPU).

One run is SIGKILLed three times -- while generating, in the middle of a gradient-accumulation
window, and while a checkpoint is being written -- and resumed after each kill. The training
runs in subprocesses; this file is also the script they run. ``RELIABILITY_KILL=point:n`` makes
the child kill itself (SIGKILL, nothing is cleaned up) on the n-th time it reaches ``point``:

* ``generate`` -- the generator's ``generate`` call (the start of a generation cycle);
* ``micro`` -- a training forward pass (a micro-step; with gradient_accumulation_steps 2 an
  odd-numbered one is the middle of an accumulation window);
* ``checkpoint`` -- writing ``optimizer.pt`` of a checkpoint (its model is already written to
  the temporary directory, its ``trainer_state.json`` not yet).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"]]
VOLATILE = ("timing/", "tokens_per_second", "peak_memory_gb")


def char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(tiny_model: dict, output_dir: Path) -> dict[str, Any]:
    # 4 micro-steps per generation, an update every 2 (so old log-probs are computed), a
    # checkpoint after every update: checkpoints 1, 3, 5 are in the middle of a cycle.
    return {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 6,
        "save_steps": 1,
        "save_total_limit": None,
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 4,
        "num_generations": 4,
        "max_completion_length": 5,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
        "report_to": ["jsonl"],
        "seed": 5,
    }


def _train(config: Path, *, resume: bool, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RELIABILITY_KILL"}
    env["OMP_NUM_THREADS"] = "1"  # a tiny model gains nothing from more threads; on a busy machine they spin
    if kill is not None:
        env["RELIABILITY_KILL"] = kill
    args = [sys.executable, __file__, str(config)] + (["--resume"] if resume else [])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)


def _checkpoints(output_dir: Path) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def _weights(output_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "checkpoints" / "checkpoint-6" / "model" / "model.safetensors"))


def _stable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.slow
def test_killed_three_times_and_resumed_equals_an_uninterrupted_run(tiny_model: dict, tmp_path: Path) -> None:
    import torch

    from grpo_plugins.checkpoint import latest_checkpoint
    from grpo_plugins.metrics import read_metrics

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for name, out in (("straight", straight), ("killed", killed)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_config(tiny_model, out)))
    cfg = tmp_path / "killed.json"

    done = _train(tmp_path / "straight.json", resume=False)
    assert done.returncode == 0, done.stderr[-3000:]

    # 1. Killed while generating the second cycle: steps 1 and 2 are saved.
    run = _train(cfg, resume=False, kill="generate:2")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert latest_checkpoint(killed).name == "checkpoint-2"

    # 2. Resumed, killed in the middle of step 4's accumulation window (its first micro-step done).
    run = _train(cfg, resume=True, kill="micro:4")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert latest_checkpoint(killed).name == "checkpoint-3"

    # 3. Resumed from that mid-cycle checkpoint, killed while writing checkpoint 5.
    run = _train(cfg, resume=True, kill="checkpoint:2")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert ".tmp-checkpoint-5" in _checkpoints(killed) and "checkpoint-5" not in _checkpoints(killed)
    assert not (killed / "checkpoints" / ".tmp-checkpoint-5" / "trainer_state.json").exists()
    # A checkpoint without its completion marker (trainer_state.json, written last) is never
    # picked, whatever its step number says.
    (killed / "checkpoints" / "checkpoint-9" / "model").mkdir(parents=True)
    assert latest_checkpoint(killed).name == "checkpoint-4"

    # 4. Resumed to the end.
    run = _train(cfg, resume=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stderr and "checkpoint-4" in run.stderr
    assert ".tmp-checkpoint-5" not in _checkpoints(killed)

    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ma, mb = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in ma] == [1, 2, 3, 4, 5, 6]
    assert _stable(ma) == _stable(mb)


if __name__ == "__main__":  # the training subprocess: CONFIG.json [--resume]
    import logging

    logging.basicConfig(level=logging.INFO)
    from grpo_plugins.engine import Engine

    if os.environ.get("RELIABILITY_KILL"):
        sys.path.insert(0, str(Path(__file__).parent))
        from kill_points import install_kill

        install_kill(os.environ["RELIABILITY_KILL"])
    config = json.loads(Path(sys.argv[1]).read_text())
    resume = "--resume" in sys.argv[2:]
    Engine(config, rewards=[char_sum], dataset=PROMPTS).train(resume=True if resume else None)
