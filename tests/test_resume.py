"""Kill-and-resume: a run SIGKILLed after its first checkpoint and resumed ends exactly where an
uninterrupted run ends (parameters and metrics).

The training runs in subprocesses (this file is also the script they run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]
#: Metrics that measure time or memory differ between runs; everything else must be equal.
VOLATILE = ("timing/", "tokens_per_second", "peak_memory_gb")


def slow_char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    """Sum of character codes mod 7; sleeps so that the run can be killed mid-way."""
    time.sleep(float(os.environ.get("TEST_REWARD_SLEEP", "0")))
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(tiny_model: dict, output_dir: Path) -> dict[str, Any]:
    # 3 updates per cycle, a checkpoint every 2: checkpoints 2 and 4 fall inside a cycle, and the
    # logging window (3 steps) is open when they are written.
    return {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 6,
        "save_steps": 2,
        "save_total_limit": None,
        "logging_steps": 3,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 3,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
        "warmup_steps": 1,
        "report_to": ["jsonl", "tensorboard"],
        "seed": 3,
    }


def _start(config_path: Path, *extra: str, sleep: float = 0.0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TEST_REWARD_SLEEP": str(sleep)}
    return subprocess.Popen(
        [sys.executable, __file__, str(config_path), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _final_weights(output_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "checkpoints" / "checkpoint-6" / "model" / "model.safetensors"))


def _stable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.fixture(scope="module")
def straight(tiny_model: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of an uninterrupted run of ``_config``: every test here interrupts the
    same config and compares with it, so it runs once."""
    root = tmp_path_factory.mktemp("straight")
    (root / "straight.json").write_text(json.dumps(_config(tiny_model, root / "straight")))
    proc = _start(root / "straight.json")
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()[-3000:]
    return root / "straight"


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(tiny_model: dict, straight: Path, tmp_path: Path) -> None:
    import torch

    from grpo_plugins.metrics import read_metrics

    killed = tmp_path / "killed"
    (tmp_path / "killed.json").write_text(json.dumps(_config(tiny_model, killed)))

    proc = _start(tmp_path / "killed.json", sleep=1.5)
    first = killed / "checkpoints" / "checkpoint-2"
    deadline = time.monotonic() + 300
    while not first.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "checkpoint-6").exists()  # it really was cut short

    proc = _start(tmp_path / "killed.json", "--resume")
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()[-3000:]

    a, b = _final_weights(straight), _final_weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ma, mb = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in ma] == [3, 6]
    assert _stable(ma) == _stable(mb)


@pytest.mark.slow
@pytest.mark.parametrize("during", ["scoring", "training"])
def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(tiny_model: dict, straight: Path, tmp_path: Path, during: str) -> None:
    """Ctrl-C while a rollout is scored saves the cycle's start; while a step trains, it finishes
    that optimizer step and saves there. Either way the resumed run ends as an uninterrupted one."""
    import torch

    from grpo_plugins.checkpoint import latest_checkpoint
    from grpo_plugins.metrics import read_metrics

    stopped = tmp_path / "stopped"
    (tmp_path / "stopped.json").write_text(json.dumps(_config(tiny_model, stopped)))

    slow = {"TEST_REWARD_SLEEP": "1.5"} if during == "scoring" else {"TEST_TRAIN_SLEEP": "1.5"}
    proc = subprocess.Popen([sys.executable, __file__, str(tmp_path / "stopped.json")], env={**os.environ, **slow},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = stopped / "checkpoints" / "checkpoint-2"
    deadline = time.monotonic() + 300
    while not first.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.5)  # into step 3's training, or the next cycle's scoring
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode != 0 and "TrainingInterrupted" in output, output[-3000:]
    saved = latest_checkpoint(stopped)
    assert saved is not None and saved.name == "checkpoint-3", (saved, output[-3000:])  # saved at the Ctrl-C

    proc = _start(tmp_path / "stopped.json", "--resume")
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()[-3000:]
    a, b = _final_weights(straight), _final_weights(stopped)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _stable(read_metrics(straight)) == _stable(read_metrics(stopped))


def _slow_training() -> None:
    """TEST_TRAIN_SLEEP: each micro-step sleeps first, so that a Ctrl-C lands while a step trains."""
    seconds = float(os.environ.get("TEST_TRAIN_SLEEP", "0"))
    if not seconds:
        return
    from grpo_plugins.update import PolicyUpdate

    micro_step = PolicyUpdate.micro_step

    def sleepy(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return micro_step(self, *args, **kwargs)

    PolicyUpdate.micro_step = sleepy  # type: ignore[method-assign]


if __name__ == "__main__":  # the training subprocess: CONFIG.json [--resume]
    from grpo_plugins.engine import Engine

    _slow_training()

    config = json.loads(Path(sys.argv[1]).read_text())
    resume = "--resume" in sys.argv[2:]
    Engine(config, rewards=[slow_char_sum], dataset=PROMPTS).train(resume=True if resume else None)
