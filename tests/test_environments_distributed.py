"""Two CPU processes (torchrun, gloo) run tool-calling episodes exactly like one process: the
same episodes, advantages over the gathered batch, the env/* metrics gathered from both, and
the same weights. The scripted policy of test_environments (a function of the prompt and of the
row's position) gives both runs the same episodes. This file is also the script the runs execute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "answer": str(a * b)}
    for a, b in [(123, 456), (77, 88), (12, 34), (505, 6)]
]


def _config(tiny_model: dict, output_dir: Path, per_device: int) -> dict[str, Any]:
    return {
        "model": tiny_model,
        "task": None,
        "rewards": ["correct_answer"],
        "generator": "scripted_tools",
        "environment": {"name": "tool_calling", "params": {"tools_in": "template"}},
        "output_dir": str(output_dir),
        "max_steps": 2,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": 4,
        "max_completion_length": 120,
        "max_prompt_length": None,
        "scale_rewards": "batch",
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "log_completions": True,
        "seed": 3,
        "dtype": "float32",
    }


@pytest.mark.slow
def test_two_processes_run_the_same_episodes_and_gather_env_metrics(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from grpo_plugins.metrics import read_metrics
    from grpo_plugins.testing import tiny_model_spec

    model = tiny_model_spec(tmp_path / "model", "llama", max_position_embeddings=1024)
    one, two = tmp_path / "one", tmp_path / "two"
    (tmp_path / "one.json").write_text(json.dumps(_config(model, one, per_device=8)))
    (tmp_path / "two.json").write_text(json.dumps(_config(model, two, per_device=4)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, __file__, str(tmp_path / "one.json")], env=env, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]  # a free port
    run = subprocess.run([*launcher, __file__, str(tmp_path / "two.json")], env=env, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]

    c1 = [json.loads(line) for line in (one / "completions.jsonl").read_text().splitlines()]
    c2 = [json.loads(line) for line in (two / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in c1] == [r["completion"] for r in c2]
    assert any(len(r["completion"]) == 3 for r in c1)  # call, tool message, answer
    m1, m2 = read_metrics(one), read_metrics(two)
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("env/turns", "env/tool_calls", "env/model_tokens", "env/environment_tokens", "loss", "reward"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-5, abs=1e-7), key
    assert m1[0]["env/turns"] == 1.5
    w1 = load_file(str(one / "checkpoints" / "checkpoint-2" / "model" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "checkpoint-2" / "model" / "model.safetensors"))
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-5)


if __name__ == "__main__":  # a training process: CONFIG.json
    from grpo_plugins.engine import Engine
    from grpo_plugins.registry import get_registry
    from grpo_plugins.testing import ScriptedGenerator
    from test_environments import Policy

    class ScriptedTools(ScriptedGenerator):
        def __init__(self) -> None:
            super().__init__(Policy())

    get_registry().register("generator", "scripted_tools", ScriptedTools)
    config = json.loads(Path(sys.argv[1]).read_text())
    Engine(config, dataset=ROWS).train()
