"""GPU check before a release: every generator x {full fine-tuning, LoRA} x {bf16, fp16}.

    python bench/check_generators.py --out outputs/check_generators

Each cell trains a random-init Qwen2-0.5B-shape model, saved to a local folder with the SmolLM2
tokenizer (``BENCH_TOKENIZER``, default ``.benchdata/tokenizer``), on the built-in arithmetic
task with the config's defaults; only the model, ``dtype``, ``lora``, ``generator``, the learning
rate (``--lr``, ``--lora-lr``: large enough that weights the sampler failed to receive would show)
and ``max_steps`` are set. Each cell runs in its own process: the ``vllm`` cells one at a time,
then the others ``--jobs`` at a time, sharing the GPU. A cell passes when it finishes its steps with finite losses and, where the loss receives
the sampler's log-probs (the ``vllm`` generator), the sampler and the trainer agree at every
step: the mean |sampler - trainer| log-prob per token stays under ``--max-gap`` and the
importance-sampling ratio's mean within 1 +- ``--max-ratio-off``. For ``vllm``, every step must
also have synced the weights into the engine.

Writes ``OUT/check_generators.json`` (every cell's per-step series) and prints a table; exits 1
when a cell fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GENERATORS = ("transformers", "static", "vllm")
MODES = ("full", "lora")
DTYPES = ("bfloat16", "float16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and the model")
    parser.add_argument("--generators", nargs="+", choices=GENERATORS, default=list(GENERATORS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per cell")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate of full fine-tuning")
    parser.add_argument("--lora-lr", type=float, default=1e-4, help="learning rate of LoRA")
    parser.add_argument("--jobs", type=int, default=4, help="cells running at once")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the vllm engine's share")
    parser.add_argument("--max-gap", type=float, default=0.05, help="largest mean |sampler - trainer| log-prob")
    parser.add_argument("--max-ratio-off", type=float, default=0.05, help="largest |mean IS ratio - 1|")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="a config value for every cell (YAML value), e.g. max_completion_length=32 for a dry run",
    )
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # a child process: GENERATOR/MODE/DTYPE
    return parser.parse_args(argv)


def save_model(folder: Path) -> None:
    """The random Qwen2-0.5B-shape model and the tokenizer, saved where every cell loads them."""
    if (folder / "config.json").is_file():
        return
    from bench._common import build_model, load_tokenizer

    model = build_model(seed=0, device="cpu")
    model.save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)


def cell_config(args: argparse.Namespace, generator: str, mode: str, dtype: str) -> dict[str, Any]:
    import yaml

    params = {"gpu_memory_utilization": args.gpu_memory_utilization} if generator == "vllm" else {}
    return {
        "model": str(args.out / "model"),
        "dtype": dtype,
        "lora": {"r": 16, "lora_alpha": 32} if mode == "lora" else None,
        "learning_rate": args.lora_lr if mode == "lora" else args.lr,
        "generator": {"name": generator, "params": params},
        "max_steps": args.steps,
        "output_dir": str(args.out / "runs" / f"{generator}-{mode}-{dtype}"),
        "save_steps": 100000,
        "report_to": [],
        **{k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)},
    }


def run_cell(args: argparse.Namespace, generator: str, mode: str, dtype: str) -> dict[str, Any]:
    """Train one cell in this process; returns its record."""
    import yaml

    from bench.check_vllm import run

    config = cell_config(args, generator, mode, dtype)
    path = args.out / "configs" / f"{generator}-{mode}-{dtype}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: v for k, v in config.items() if k not in ("generator", "max_steps")}))
    record = run(
        f"{generator}/{mode}/{dtype}", generator=config["generator"], completions=0, tokens=0,
        steps=args.steps, lr=config["learning_rate"], config_file=str(path),
    )
    return record


def verdict(args: argparse.Namespace, generator: str, record: dict[str, Any]) -> list[str]:
    """What is wrong with a finished cell (empty: it passed)."""
    if "error" in record:
        return [record["error"][:200]]
    problems = []
    losses = record.get("losses", [])
    if len(losses) < args.steps:
        problems.append(f"{len(losses)} of {args.steps} steps")
    if any(not math.isfinite(x) for x in losses):
        problems.append("a non-finite loss")
    gaps = [m["abs_mean"] for m in record.get("mismatch", [])]
    if generator == "vllm":
        if len(gaps) < args.steps:
            problems.append(f"the sampler's log-probs reached the loss in {len(gaps)} of {args.steps} steps")
        if gaps and max(gaps) > args.max_gap:
            problems.append(f"mean |sampler - trainer| log-prob up to {max(gaps):.4f}")
        means = [r["mean"] for r in record.get("is_ratio", []) if r.get("mean") is not None]
        if means and max(abs(m - 1.0) for m in means) > args.max_ratio_off:
            problems.append(f"IS ratio mean between {min(means):.3f} and {max(means):.3f}")
        syncs = record.get("generator_stats", {}).get("syncs")
        if syncs is not None and syncs < args.steps - 1:
            problems.append(f"{syncs} weight syncs in {args.steps} steps")
    return problems


def table(records: dict[str, dict[str, Any]], failures: dict[str, list[str]]) -> str:
    lines = [f"{'cell':<28} {'steps':>5} {'step s':>7} {'gap mean/max':>14} {'IS mean range':>14}  verdict"]
    for name, r in records.items():
        if "error" in r:
            lines.append(f"{name:<28} ERROR {r['error'][:80]}")
            continue
        gaps = [m["abs_mean"] for m in r.get("mismatch", [])]
        means = [x["mean"] for x in r.get("is_ratio", []) if x.get("mean") is not None]
        gap = f"{sum(gaps) / len(gaps):.4f}/{max(gaps):.4f}" if gaps else "-"
        ratio = f"{min(means):.3f}..{max(means):.3f}" if means else "-"
        step = r.get("step_s")
        lines.append(
            f"{name:<28} {len(r.get('losses', [])):>5} {step if step is None else format(step, '.2f'):>7} "
            f"{gap:>14} {ratio:>14}  {'ok' if not failures[name] else '; '.join(failures[name])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.cell:
        generator, mode, dtype = args.cell.split("/")
        try:
            record = run_cell(args, generator, mode, dtype)
        except Exception as exc:
            record = {"error": repr(exc), "trace": traceback.format_exc()}
            print(record["trace"], file=sys.stderr, flush=True)
        (args.out / "cells").mkdir(parents=True, exist_ok=True)
        (args.out / "cells" / f"{generator}-{mode}-{dtype}.json").write_text(json.dumps(record, default=str))
        return 0

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    save_model(args.out / "model")
    cells = list(itertools.product(args.generators, args.modes, args.dtypes))
    # vllm cells one at a time and alone: a vLLM engine sizes its cache from the device's free
    # memory while it starts, which other processes' allocations make wrong ("no available
    # memory for the cache blocks"). The other cells then share the GPU, --jobs at a time.
    alone = [c for c in cells if c[0] == "vllm"]
    shared = [c for c in cells if c[0] != "vllm"]

    def launch(cell: tuple[str, str, str]) -> tuple[str, float]:
        name = "/".join(cell)
        start = time.perf_counter()
        log = (args.out / "logs" / f"{'-'.join(cell)}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as handle:
            subprocess.run([sys.executable, __file__, *argv, "--cell", name], stdout=handle, stderr=subprocess.STDOUT)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        return name, time.perf_counter() - start

    seconds = dict(map(launch, alone))
    with ThreadPoolExecutor(args.jobs) as pool:
        seconds.update(pool.map(launch, shared))
    records: dict[str, dict[str, Any]] = {}
    for cell in cells:
        name = "/".join(cell)
        path = args.out / "cells" / f"{'-'.join(cell)}.json"
        records[name] = json.loads(path.read_text()) if path.is_file() else {"error": "the cell's process wrote no record"}
        records[name]["wall_s"] = seconds[name]
    failures = {name: verdict(args, name.split("/")[0], r) for name, r in records.items()}
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "failures": failures, "cells": records}
    (args.out / "check_generators.json").write_text(json.dumps(summary, indent=1, default=str))
    print(table(records, failures), flush=True)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
