"""Where a GRPO step of this project's Engine spends its time and memory (bench_grpo.py's workload).

    python bench/profile_step.py --tokens 256 --train-chunk-rows 16 --profile

For each phase (generation, each micro-step, the optimizer step) it records, per step: GPU memory
allocated before, the phase's own peak, allocated after; the wall time (CUDA-synchronised) and the
host time until the phase returned (before synchronising: the Python/launch cost). With
``--profile`` one micro-step after the warm-up runs under ``torch.profiler`` and the op tables
(by self CPU time and by device time) are written to ``$OUT/profile_T{T}.txt``. Writes
``$OUT/profile_step.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
import bench.bench_grpo as bench_grpo  # noqa: E402
from bench._common import DEVICE, build_model, gib, length_reward, load_tokenizer, median, out_dir, reset_peak, sync, write_json  # noqa: E402
from bench.bench_grpo import _reset_accelerate, dataset, ours_config  # noqa: E402

#: --compiled-logps: the log-prob chunks run compiled, not as grpo_plugins.fused_logprobs's kernels.
COMPILED_LOGPS = False


def _instrument(record: list[dict[str, Any]], phase: str, fn: Any, profile_at: int | None = None) -> Any:
    calls = {"n": 0}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        prof = None
        if profile_at is not None and calls["n"] == profile_at:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            )
            prof.__enter__()
        out = fn(*args, **kwargs)
        host = time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            record.append({"phase": phase, "profile": prof})
        calls["n"] += 1
        record.append(
            {
                "phase": phase,
                "call": calls["n"] - 1,
                "before_gib": gib(before),
                "peak_gib": gib(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else 0.0,
                "after_gib": gib(torch.cuda.memory_allocated()) if DEVICE == "cuda" else 0.0,
                "wall_s": wall,
                "host_s": host,
            }
        )
        return out

    return wrapper


def run(
    T: int, steps: int, warmup: int, generator: dict[str, Any], chunk_rows: int | None, profile: bool,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from grpo_plugins.engine import Engine

    record: list[dict[str, Any]] = []
    config = {**ours_config(T, steps, warmup, generator, chunk_rows), **(overrides or {})}
    engine = Engine(config, model=build_model(seed=0), tokenizer=load_tokenizer(), rewards=[length_reward], dataset=dataset())
    setup = engine._setup

    def setup_and_instrument() -> None:  # the generator and the update exist once it is set up
        setup()
        chunk_fn = engine.update.policy.chunk_fn
        if COMPILED_LOGPS and hasattr(chunk_fn, "fallback"):  # the compiled chunk the fused kernels replace
            engine.update.policy.chunk_fn = chunk_fn.fallback
        engine.generator.generate = _instrument(record, "generate", engine.generator.generate)
        engine.update.micro_step = _instrument(record, "micro_step", engine.update.micro_step, warmup if profile else None)

    engine._setup = setup_and_instrument  # type: ignore[method-assign]
    engine._optimizer_step = _instrument(record, "optimizer_step", engine._optimizer_step)
    reset_peak()
    engine.train()
    tables = ""
    rows = []
    for r in record:
        if "profile" in r:
            averages = r["profile"].key_averages()
            tables += f"== T={T} chunk_rows={chunk_rows}: by self CPU time\n"
            tables += averages.table(sort_by="self_cpu_time_total", row_limit=30)
            tables += f"\n== T={T} chunk_rows={chunk_rows}: by device time\n"
            tables += averages.table(sort_by="self_cuda_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=25)
        else:
            rows.append(r)
    if tables:
        path = out_dir() / f"profile_T{T}_c{chunk_rows}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tables)
    summary = {}
    for phase in ("generate", "micro_step", "optimizer_step"):
        measured = [r for r in rows if r["phase"] == phase][warmup:]
        summary[phase] = {k: median([r[k] for r in measured]) for k in ("before_gib", "peak_gib", "after_gib", "wall_s", "host_s")}
    # The instrumented methods close over the engine (a reference cycle): without a collection
    # the next setting of the same process starts with this run's model and optimizer resident.
    del engine, setup, setup_and_instrument, record
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"summary": summary, "calls": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--train-chunk-rows", type=int, nargs="+", default=[0], help="0: no row chunks")
    parser.add_argument("--generator-params", default="{}")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--shape", default="smol-vocab-0.4b", help="model shape: " + ", ".join(common.SHAPES))
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    parser.add_argument("--overrides", default="{}", help='JSON config overrides, e.g. \'{"gradient_checkpointing": false}\'')
    parser.add_argument("--optimizer-impl", choices=["engine", "foreach"], default="engine", help="foreach: force AdamW's multi-tensor path")
    parser.add_argument(
        "--cudnn-attention", action="store_true",
        help="let the training passes use cuDNN's attention first (a candidate: the passes without a padding mask "
        "have no query row that attends to nothing, which is what its NaN needs)",
    )
    parser.add_argument(
        "--compiled-logps", action="store_true",
        help="the log-prob chunks as the compiled torch chunk (reads the logits ~twice per pass) instead of "
        "grpo_plugins.fused_logprobs's kernels (the default on CUDA)",
    )
    parser.add_argument(
        "--keep-logits", action="store_true",
        help="a candidate: the log-prob chunks keep their logits for backward instead of recomputing the LM head there "
        "(more memory: a chunk's logits per chunk of a pass)",
    )
    args = parser.parse_args()
    global COMPILED_LOGPS
    COMPILED_LOGPS = args.compiled_logps
    if args.keep_logits:
        import grpo_plugins.logprobs as logprobs

        logprobs.checkpoint = lambda fn, *inputs, use_reentrant=False: fn(*inputs)  # type: ignore[assignment]
    if args.cudnn_attention:
        import contextlib

        from torch.nn.attention import SDPBackend, sdpa_kernel

        import grpo_plugins.attention as attention

        @contextlib.contextmanager
        def cudnn_first() -> Any:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *attention.TRAINING_SDPA_BACKENDS], set_priority=True):
                yield

        attention.training_attention = cudnn_first  # read by training_passes at each call
    common.ACTIVE_SHAPE = args.shape
    bench_grpo.LORA_R = args.lora
    if args.optimizer_impl == "foreach":
        adamw = torch.optim.AdamW

        def foreach_adamw(*a: Any, **k: Any) -> Any:
            return adamw(*a, **{**k, "fused": None, "foreach": True})

        torch.optim.AdamW = foreach_adamw  # type: ignore[misc,assignment]
    generator = {"name": "static", "params": json.loads(args.generator_params)}
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "args": vars(args)}
    for T in args.tokens:
        for c in args.train_chunk_rows:
            _reset_accelerate()
            key = f"T{T}_c{c}"
            out = run(T, args.steps, args.warmup, generator, c or None, args.profile, json.loads(args.overrides))
            results[key] = out
            write_json(out_dir() / "profile_step.json", results)
            print(f"== {key}")
            for phase, s in out["summary"].items():
                print(
                    f"  {phase:<15} wall {s['wall_s']:.3f} s  host {s['host_s']:.3f} s  "
                    f"mem before {s['before_gib']:.2f}  peak {s['peak_gib']:.2f}  after {s['after_gib']:.2f} GiB",
                    flush=True,
                )
            reset_peak()


if __name__ == "__main__":
    main()
