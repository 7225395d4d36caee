"""FSDP (``fsdp: true``) on two CPU processes (torchrun, gloo): sharded training equals a plain
one-process run, generation from gathered weights equals generation from the full model, and
sharded checkpoints resume exactly -- after kill -9, and on one process from a two-process
checkpoint taken between generation cycles.

The runs use test_distributed's deterministic generator, so one and two processes see the same
completions. This file is also the script the runs execute:
``train CONFIG.json [--resume]`` (``FSDP_KILL=point:n`` makes each process SIGKILL itself the
n-th time it reaches ``point``: ``micro``, a training forward; ``checkpoint``, writing a
checkpoint's scheduler.pt, after its shards) and ``generate MODEL.json OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from kill_points import install_kill  # noqa: E402
from test_distributed import PROMPTS, _config, _fixed_generator, char_sum  # noqa: E402

VOLATILE = ("timing/", "tokens_per_second", "peak_memory_gb")
# --standalone: a free port for each launch (fixed ports collide with other runs on the machine)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _fsdp_config(tiny_model: dict, output_dir: Path, per_device: int, fsdp: bool = True) -> dict[str, Any]:
    # 2 optimizer steps per generation cycle, a checkpoint after each: 1 and 3 are mid-cycle.
    config = {**_config(tiny_model, output_dir, per_device), "save_steps": 1, "save_total_limit": None}
    return {**config, "fsdp": True} if fsdp else config


def _env(kill: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FSDP_KILL"}
    env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    if kill is not None:
        env["FSDP_KILL"] = kill
    return env


def _run(config: dict[str, Any], path: Path, *, processes: int, resume: bool = False, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    path.write_text(json.dumps(config))
    launcher = TORCHRUN if processes == 2 else [sys.executable]
    args = [*launcher, __file__, "train", str(path)] + (["--resume"] if resume else [])
    return subprocess.run(args, env=_env(kill), capture_output=True, text=True, timeout=300)


def _weights(output_dir: Path, step: int = 4) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "checkpoints" / f"checkpoint-{step}" / "model" / "model.safetensors"))


def _stable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.fixture(scope="module")
def fsdp_run(tiny_model: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-process FSDP run (4 steps, a checkpoint after each)."""
    root = tmp_path_factory.mktemp("fsdp")
    run = _run(_fsdp_config(tiny_model, root / "out", per_device=4), root / "config.json", processes=2)
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "out"


@pytest.mark.slow
def test_two_sharded_processes_train_like_one_plain_process(tiny_model: dict, fsdp_run: Path, tmp_path: Path) -> None:
    import torch

    from grpo_plugins.metrics import read_metrics

    plain = tmp_path / "plain"
    run = _run(_fsdp_config(tiny_model, plain, per_device=8, fsdp=False), tmp_path / "plain.json", processes=1)
    assert run.returncode == 0, run.stderr[-3000:]

    checkpoint = fsdp_run / "checkpoints" / "checkpoint-4"
    assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "optimizer.pt").exists()  # the optimizer state is in the shards

    def completions(out: Path) -> list[tuple[str, str, float]]:
        rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        return [(r["prompt"], r["completion"], r["advantage"]) for r in rows]

    c1, c2 = completions(plain), completions(fsdp_run)
    assert len(c1) == 32 and [r[:2] for r in c1] == [r[:2] for r in c2]
    torch.testing.assert_close(torch.tensor([r[2] for r in c2]), torch.tensor([r[2] for r in c1]), rtol=0, atol=1e-6)
    for step in (2, 4):  # between cycles, and the end
        w1, w2 = _weights(plain, step), _weights(fsdp_run, step)
        assert w1.keys() == w2.keys()
        for key in w1:  # gradients are summed in another order (reduce-scatter): ~1e-6 apart
            torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-5)
    first, last = _weights(plain, 1), _weights(plain, 4)
    assert max(float((last[k] - first[k]).abs().max()) for k in first) > 1e-3  # the weights did train
    m1, m2 = read_metrics(plain), read_metrics(fsdp_run)
    assert [r["step"] for r in m2] == [1, 2, 3, 4]
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("reward", "loss", "grad_norm", "kl", "num_tokens", "entropy"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process(tiny_model: dict, fsdp_run: Path, tmp_path: Path) -> None:
    """Checkpoint 2 lies between generation cycles: one process (same global batch) continues it
    to the weights and metrics of the uninterrupted two-process run."""
    import torch

    from grpo_plugins.metrics import read_metrics

    out = tmp_path / "one"
    shutil.copytree(fsdp_run / "checkpoints" / "checkpoint-2", out / "checkpoints" / "checkpoint-2")
    run = _run(_fsdp_config(tiny_model, out, per_device=8), tmp_path / "one.json", processes=1, resume=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stderr and "over 1 process" in run.stderr
    a, b = _weights(fsdp_run), _weights(out)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6)
    m2, m1 = read_metrics(fsdp_run)[2:], read_metrics(out)
    assert [r["step"] for r in m1] == [3, 4]
    for r2, r1 in zip(m2, m1, strict=True):
        for key in ("reward", "loss", "grad_norm", "kl"):
            assert r1[key] == pytest.approx(r2[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_killed_twice_and_resumed_equals_an_uninterrupted_run(tiny_model: dict, fsdp_run: Path, tmp_path: Path) -> None:
    from grpo_plugins.checkpoint import latest_checkpoint
    from grpo_plugins.metrics import read_metrics

    killed = tmp_path / "killed"
    config = _fsdp_config(tiny_model, killed, per_device=4)
    # 1. Killed in the middle of step 2's accumulation window (its first micro-step done).
    run = _run(config, tmp_path / "killed.json", processes=2, kill="micro:3")
    assert run.returncode != 0 and "Signal 9 (SIGKILL)" in run.stderr, run.stderr[-3000:]
    assert latest_checkpoint(killed).name == "checkpoint-1"  # mid-cycle: each process's rollout saved
    # 2. Resumed from it, killed while writing checkpoint 3 (its shards are written).
    run = _run(config, tmp_path / "killed.json", processes=2, resume=True, kill="checkpoint:2")
    assert run.returncode != 0, run.stderr[-3000:]
    assert (killed / "checkpoints" / ".tmp-checkpoint-3" / "sharded" / ".metadata").is_file()
    assert latest_checkpoint(killed).name == "checkpoint-2"
    # 3. Resumed to the end.
    run = _run(config, tmp_path / "killed.json", processes=2, resume=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checkpoint-2 at step 2" in run.stderr

    a, b = _weights(fsdp_run), _weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key
    assert _stable(read_metrics(fsdp_run)) == _stable(read_metrics(killed))


@pytest.mark.slow
def test_generation_from_gathered_weights_equals_the_full_model(tiny_model: dict, tmp_path: Path) -> None:
    """Each process samples its own prompts (rank 0 makes one call more) from the sharded
    model's gathered weights: the same tokens and log-probs as from an unsharded copy."""
    (tmp_path / "model.json").write_text(json.dumps(tiny_model))
    args = [*TORCHRUN, __file__, "generate", str(tmp_path / "model.json"), str(tmp_path)]
    run = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["calls"] == 2 - rank
        for name in ("static", "transformers"):
            assert result[name] == {"ids_equal": True, "logps_equal": True, "tokens": result[name]["tokens"]}
            assert result[name]["tokens"] > 0
        assert result["sharded_after"] is True  # the window released the full weights


def test_fsdp_config_refuses_what_it_cannot_shard() -> None:
    from grpo_plugins.config import ConfigError, load_config

    assert load_config({"fsdp": True}).fsdp.reshard_after_forward is True
    assert load_config({"fsdp": False}).fsdp is None
    cases = [
        ({"fsdp": True, "lora": {"r": 8}}, "lora", "LoRA"),
        ({"fsdp": True, "dtype": "float16"}, "dtype", "bfloat16"),
        ({"fsdp": True, "fast_inference": True}, "fast_inference", "static generator"),
        ({"fsdp": "full_shard auto_wrap"}, "fsdp", "fsdp: true"),
        ({"fsdp": {"reshard": True}}, "fsdp.reshard", "reshard_after_forward"),
        ({"fsdp": True, "train_pass_tokens": 8192}, "train_pass_tokens", "train_chunk_rows"),
    ]
    assert load_config({"fsdp": True}).train_pass_tokens == "auto"  # no bound under fsdp (run_parts)
    for config, field, words in cases:
        with pytest.raises(ConfigError) as err:
            load_config(config)
        assert f"{field}:" in str(err.value) and words in str(err.value), str(err.value)


# -- the processes --------------------------------------------------------------------------------


def _train(config_path: str, resume: bool) -> None:
    import logging

    from grpo_plugins.engine import Engine
    from grpo_plugins.registry import get_registry

    logging.basicConfig(level=logging.INFO)
    if os.environ.get("FSDP_KILL"):
        install_kill(os.environ["FSDP_KILL"], checkpoint_file="scheduler.pt")
    get_registry().register("generator", "fixed_test", _fixed_generator())
    config = json.loads(Path(config_path).read_text())
    Engine(config, rewards=[char_sum], dataset=PROMPTS).train(resume=True if resume else None)


def _generate(model_path: str, out_dir: str) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from grpo_plugins.config import FSDPSettings
    from grpo_plugins.kinds import SamplingSettings
    from grpo_plugins.models import load_model
    from grpo_plugins.registry import get_registry
    from grpo_plugins.sharding import gathered, shard_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, tokenizer = load_model(json.loads(Path(model_path).read_text()), dtype="float32", seed=0)
    full = copy.deepcopy(model)
    shard_model(model, FSDPSettings(), torch.device("cpu"), 2)
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 40]]
    calls = [prompts[rank::2]] + ([prompts[:3]] if rank == 0 else [])  # rank 0 makes one call more
    sampling = SamplingSettings(max_completion_length=12, seed=7)
    result: dict[str, Any] = {"calls": len(calls)}
    for name in ("static", "transformers"):
        outputs = []
        for m in (model, full):
            generator = get_registry().build("generator", name)
            generator.setup(m, tokenizer, sampling)
            with gathered(m):
                outputs.append([generator.generate(batch) for batch in calls])
        sharded, reference = outputs
        result[name] = {
            "ids_equal": all(a.completion_ids.equal(b.completion_ids) for a, b in zip(sharded, reference)),
            "logps_equal": all(a.sampling_logps.equal(b.sampling_logps) for a, b in zip(sharded, reference)),
            "tokens": sum(int(a.completion_mask.sum()) for a in sharded),
        }
    weight = model.model.layers[0].mlp.up_proj.weight
    result["sharded_after"] = type(weight).__name__ == "DTensor" and weight.to_local().shape[0] * 2 == weight.shape[0]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "train":
        _train(sys.argv[2], "--resume" in sys.argv[3:])
    else:
        _generate(sys.argv[2], sys.argv[3])
