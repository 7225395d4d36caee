"""Multi-GPU checks of the Engine: DDP / FSDP equivalence with one process, and
kill -9 + resume under FSDP. Each training run is a subprocess (torchrun for several processes).

    python bench/check_multi_gpu.py equivalence [--fsdp] [--shape qwen2.5-1.5b] [--steps 4]
    python bench/check_multi_gpu.py kill-resume --fsdp --shape qwen2.5-7b [--steps 6] [--kill micro:5]

``equivalence``: one process with per_device_train_batch_size 2B against --processes (2)
processes with B each (the same global batch, the same data), completions from the
deterministic test generator of tests/test_distributed.py (a fixed function of the prompt), so
only the processes differ. Reports per-step loss / grad_norm / kl of both and the largest
|weight difference| of the final checkpoints (bf16 on a GPU: expect bf16 noise, not zero).

``kill-resume``: an uninterrupted --processes run, then the same run SIGKILLed at ``--kill``
(``micro:N``: the N-th training forward of each process) and resumed with --resume from the
latest checkpoint (a checkpoint every ``--save-steps``). Completions come from the ``static``
generator (sampling, from the gathered weights under FSDP). Reports whether the final weights
are bit-identical (sha256 per tensor; the uninterrupted run's checkpoints are deleted once
digested) and whether the metrics match (``same_metrics``).

Disk: a full fine-tuning checkpoint under FSDP holds float32 shards, AdamW state and bf16
full weights, 14 bytes per parameter (about 106 GB for the 7B shape); the killed run keeps its
last checkpoint while writing the final one. Use ``--save-steps`` to save fewer,
``--set '{"master_weights": false}'`` for bf16 shards (8 bytes per parameter), and ``OUT`` on a
disk with room.

Model, tokenizer and prompts are bench_grpo's (random init of ``--shape``, the SmolLM2
tokenizer in .benchdata/tokenizer, BENCH_TINY=1 for a dry run on a CPU with gloo). Writes
``$OUT/multi_gpu_check_<mode>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _config(args: argparse.Namespace, output_dir: Path, per_device: int, generator: str) -> dict[str, Any]:
    import torch

    return {
        "_shape": args.shape,  # bench/_common.py's model shape (popped before the Engine reads it)
        "task": None,
        "output_dir": str(output_dir),
        "dtype": "bfloat16" if torch.cuda.is_available() else "float32",
        "fsdp": True if args.fsdp else None,
        "generator": generator,
        "max_steps": args.steps,
        "save_steps": args.save_steps,
        "save_total_limit": None,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 2,
        "num_iterations": 2,
        "num_generations": 4,
        "max_completion_length": args.tokens,
        "max_prompt_length": 512,
        "scale_rewards": "batch",
        "loss_type": "dapo",
        "beta": args.beta,
        "learning_rate": 1e-5,
        "gradient_checkpointing": True,
        "logging_steps": 1,
        "report_to": ["jsonl"],
        "log_completions": True,
        "seed": 5,
        **json.loads(args.set),
    }


def _launch(config: dict[str, Any], processes: int, *, resume: bool = False, kill: str | None = None) -> tuple[int, float]:
    path = Path(config["output_dir"]).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    launcher = [sys.executable]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    env = {k: v for k, v in os.environ.items() if k != "CHECK_KILL"}
    if kill:
        env["CHECK_KILL"] = kill
    t0 = time.perf_counter()
    run = subprocess.run([*launcher, __file__, "_train", str(path)] + (["--resume"] if resume else []), env=env)
    return run.returncode, time.perf_counter() - t0


def _weights_diff(a: Path, b: Path, step: int) -> float:
    from safetensors.torch import load_file

    def load(out: Path) -> dict[str, Any]:
        weights: dict[str, Any] = {}
        for file in sorted((out / "checkpoints" / f"checkpoint-{step}" / "model").glob("*.safetensors")):
            weights.update(load_file(str(file)))
        return weights

    wa, wb = load(a), load(b)
    assert wa.keys() == wb.keys(), "the checkpoints hold different tensors"
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def _digest(out: Path, step: int) -> dict[str, str]:
    """sha256 of each tensor's bytes in checkpoint ``step``'s model/ (equal digests: bit-identical)."""
    import hashlib

    import torch
    from safetensors import safe_open

    digest = {}
    for file in sorted((out / "checkpoints" / f"checkpoint-{step}" / "model").glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                digest[key] = hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return digest


def _metrics(out: Path) -> list[dict[str, Any]]:
    from grpo_plugins.metrics import read_metrics

    keep = ("step", "loss", "grad_norm", "kl", "reward", "num_tokens", "timing/step")
    return [{k: r[k] for k in keep if k in r} for r in read_metrics(out)]


def equivalence(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    one, many = work / "one", work / "many"
    rc1, s1 = _launch(_config(args, one, args.processes * args.batch, "fixed_test"), 1)
    rcn, sn = _launch(_config(args, many, args.batch, "fixed_test"), args.processes)
    result: dict[str, Any] = {"returncodes": [rc1, rcn], "seconds": [s1, sn]}
    if rc1 == 0 and rcn == 0:
        result["max_abs_weight_diff"] = _weights_diff(one, many, args.steps)
        result["metrics_one"], result["metrics_many"] = _metrics(one), _metrics(many)
    return result


def kill_resume(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    straight, killed = work / "straight", work / "killed"
    rc, seconds = _launch(_config(args, straight, args.batch, "static"), args.processes)
    result: dict[str, Any] = {"straight": {"returncode": rc, "seconds": seconds}}
    expected = _digest(straight, args.steps) if rc == 0 else {}
    straight_metrics = _metrics(straight) if rc == 0 else []
    shutil.rmtree(straight / "checkpoints", ignore_errors=True)  # only the digest is compared: free the disk
    rc, seconds = _launch(_config(args, killed, args.batch, "static"), args.processes, kill=args.kill)
    from grpo_plugins.checkpoint import latest_checkpoint

    latest = latest_checkpoint(killed)
    result["killed"] = {"returncode": rc, "seconds": seconds, "latest_checkpoint": latest.name if latest else None}
    rc, seconds = _launch(_config(args, killed, args.batch, "static"), args.processes, resume=True)
    result["resumed"] = {"returncode": rc, "seconds": seconds}
    if rc == 0 and expected:
        got = _digest(killed, args.steps)
        result["bit_identical_weights"] = got == expected
        result["tensors_differing"] = sorted(k for k in expected if got.get(k) != expected[k])[:20]
        drop = ("timing/step",)
        a = [{k: v for k, v in r.items() if k not in drop} for r in straight_metrics]
        b = [{k: v for k, v in r.items() if k not in drop} for r in _metrics(killed)]
        result["same_metrics"] = a == b
        result["metrics_straight"], result["metrics_killed"] = a, b
    return result


def _train(config_path: str, resume: bool) -> None:
    import logging

    import torch

    import bench._common as common
    from grpo_plugins.engine import Engine
    from grpo_plugins.registry import get_registry
    from test_distributed import _fixed_generator, char_sum

    logging.basicConfig(level=logging.INFO)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kill = os.environ.get("CHECK_KILL")
    if kill:
        _install_kill(kill)
    config = json.loads(Path(config_path).read_text())
    common.ACTIVE_SHAPE = config.pop("_shape")
    get_registry().register("generator", "fixed_test", _fixed_generator())
    dtype = torch.bfloat16 if config["dtype"] == "bfloat16" else torch.float32
    model = common.build_model(seed=0, device="cpu", dtype=dtype)
    prompts = [{"prompt": p} for p in common.prompt_texts(256)]
    engine = Engine(config, model=model, tokenizer=common.load_tokenizer(), rewards=[char_sum], dataset=prompts)
    engine.train(resume=True if resume else None)


def _install_kill(spec: str) -> None:
    import torch

    import grpo_plugins.logprobs

    point, n = spec.split(":")
    if point != "micro":
        raise SystemExit(f"--kill takes micro:N, not {spec!r}")
    seen = [0]
    original = grpo_plugins.logprobs.completion_logps

    def completion_logps(*a: Any, **k: Any) -> Any:
        if torch.is_grad_enabled():
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*a, **k)

    grpo_plugins.logprobs.completion_logps = completion_logps


def main() -> None:
    if sys.argv[1:2] == ["_train"]:
        _train(sys.argv[2], "--resume" in sys.argv[3:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["equivalence", "kill-resume"])
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size of the several-process run")
    parser.add_argument("--tokens", type=int, default=64, help="max_completion_length")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--kill", default="micro:5")
    parser.add_argument("--save-steps", type=int, default=1)
    parser.add_argument("--set", default="{}", help="JSON config overrides for every run, e.g. '{\"master_weights\": false}'")
    parser.add_argument("--keep", action="store_true", help="keep the runs' output directories")
    args = parser.parse_args()
    from bench._common import out_dir, write_json

    work = out_dir() / f"multi_gpu_{args.mode}_runs"
    shutil.rmtree(work, ignore_errors=True)
    result = (equivalence if args.mode == "equivalence" else kill_resume)(args, work)
    result["args"] = vars(args)
    write_json(out_dir() / f"multi_gpu_check_{args.mode}.json", result)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("metrics_")}, indent=1))
    for key in [k for k in result if k.startswith("metrics_")]:
        print(key)
        for record in result[key]:
            print("  ", record)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
