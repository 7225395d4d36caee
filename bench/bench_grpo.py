"""GRPO step time and memory: this project's Engine vs TRL's GRPOTrainer, one command, same
model shape and initial weights, tokenizer, prompts, reward and settings (bench/README.md).

    python bench/bench_grpo.py --tokens 256 --steps 4 --warmup 2

Settings for both: bf16 weights, 8 prompts x 8 generations = 64 completions per step,
per_device_train_batch_size 64, gradient_accumulation_steps 1 (on-policy: no old-logp pass),
beta 0 (no reference pass), loss dapo, temperature 1.0, learning rate 1e-6, gradient
checkpointing on (TRL's default). The random-initialised model almost never emits EOS, so both
sample the full T tokens (the mean completion length is reported).

Seconds per step are wall-clock times between the ends of consecutive optimizer steps (CUDA
synchronised), median after the warm-up steps; generate / score / train are each framework's own
timers (TRL's profiling contexts; the Engine's timing metrics). On a single CUDA GPU each run
has a process of its own (``--no-isolate``: all in this one), so none inherits the memory that
the run before left held. Writes ``$OUT/grpo_bench.json``
and prints a table last.

Several processes (the Engine only; DDP, or FSDP with ``--ours-variants '{" fsdp": {"fsdp":
true}}'``): launch with ``torchrun --nproc_per_node N bench/bench_grpo.py --frameworks ours ...``.
Each process generates and trains per_device_train_batch_size (64 unless a variant sets it)
completions per step; the main process times the steps and writes the results, with
``processes`` and ``completions_per_s`` (all processes' completions per second).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as _common  # noqa: E402
from bench._common import (  # noqa: E402
    DEVICE,
    build_model,
    gib,
    length_reward,
    load_tokenizer,
    median,
    out_dir,
    peak,
    prompt_texts,
    reset_peak,
    sync,
    write_json,
)

RESULTS: dict[str, Any] = {"runs": {}, "errors": []}
#: LoRA rank for every framework (0: full fine-tuning); set from --lora.
LORA_R = 0


def log(msg: str) -> None:
    print(msg, flush=True)


def dataset() -> Any:
    import datasets

    return datasets.Dataset.from_dict({"prompt": prompt_texts(256)})


_RUN_NUMBERS = itertools.count()  # every process builds its runs in the same order


def _run_dir() -> str:
    """A fresh output directory, the same for every process of a torchrun launch (their parent)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return tempfile.mkdtemp(prefix="bench_ours_")
    return str(Path(tempfile.gettempdir()) / f"bench_ours_{os.getppid()}_{next(_RUN_NUMBERS)}")


def ours_config(
    T: int, steps: int, warmup: int, generator: dict[str, Any], train_chunk_rows: int | None = None
) -> dict[str, Any]:
    """The Engine config of the benchmark workload (TRL's settings in :func:`run_trl`)."""
    return {
        "task": None,
        "dtype": "bfloat16" if DEVICE == "cuda" else "float32",
        "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 1,
        "num_generations": 8,
        "max_completion_length": T,
        "max_prompt_length": 512,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": 1e-6,
        "gradient_checkpointing": True,
        "max_steps": warmup + steps,
        "logging_steps": 1,
        "save_steps": 100000,
        "report_to": [],
        "generator": generator,
        "output_dir": _run_dir(),
        "seed": 0,
        "train_chunk_rows": train_chunk_rows,
        "lora": {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": "all-linear"} if LORA_R else None,
    }


def run_ours(
    T: int,
    steps: int,
    warmup: int,
    generator: dict[str, Any],
    train_chunk_rows: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from grpo_plugins.engine import Engine

    tokenizer = load_tokenizer()
    model = build_model(seed=0)
    config = {**ours_config(T, steps, warmup, generator, train_chunk_rows), **(overrides or {})}
    engine = Engine(config, model=model, tokenizer=tokenizer, rewards=[length_reward], dataset=dataset())
    ends: list[float] = []
    original = Engine._optimizer_step

    def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        record = original(self, *args, **kwargs)
        sync()
        ends.append(time.perf_counter())
        return record

    engine._optimizer_step = timed_step.__get__(engine)  # type: ignore[method-assign]
    base = reset_peak()
    sync()
    start = time.perf_counter()
    result = engine.train()
    history = result.history
    step_times = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    measured = slice(warmup, None)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    out = {
        "step_s": median(step_times[measured]),
        "step_times": step_times,
        "processes": processes,
        "completions_per_s": processes * config["per_device_train_batch_size"] / median(step_times[measured]),
        "generate_s": median([h.get("timing/generate", float("nan")) for h in history][measured]),
        "score_s": median([h.get("timing/reward", float("nan")) for h in history][measured]),
        "train_s": median([h.get("timing/train", float("nan")) for h in history][measured]),
        "engine_step_s": median([h.get("timing/step", float("nan")) for h in history][measured]),
        "mean_length": median([h.get("completions/mean_length", float("nan")) for h in history][measured]),
        "peak_gib": gib(peak()),
        "start_allocated_gib": gib(base),
        "losses": [h.get("loss") for h in history],
        # torch.compile's cost: cumulative seconds and graphs after each step (a count that still
        # grows after step 2 is a recompilation).
        "compile_seconds": [h.get("compile/seconds") for h in history],
        "compile_graphs": [h.get("compile/graphs") for h in history],
        # with vllm_importance_sampling_correction on: how far the sampler's log-probs are from the policy's
        "sampling_logp_difference": [h.get("sampling/sampling_logp_difference/mean") for h in history],
        "nonfinite_skipped": sum(h.get("nonfinite_skipped", 0.0) for h in history),
    }
    del engine, model, result
    import shutil

    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(config["output_dir"], ignore_errors=True)  # a full fine-tuning checkpoint is GBs
    return out


def run_trl(T: int, steps: int, warmup: int, vllm: bool = False) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same workload; ``vllm``: generation by vLLM colocated in the
    training process (``use_vllm=True, vllm_mode="colocate"``), the setting TRL users take for
    speed. vLLM loads the model from a folder, so the random model is saved first."""
    import trl.extras.profiling as profiling
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timings: list[tuple[str, float]] = []
    original_log = profiling.ProfilingContext._log_metrics

    def record(self: Any, duration: float) -> None:
        timings.append((self.name, duration))
        original_log(self, duration)

    profiling.ProfilingContext._log_metrics = record  # type: ignore[method-assign]
    ends: list[float] = []
    marks: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            ends.append(time.perf_counter())
            marks.append(len(timings))

    tokenizer = load_tokenizer()
    model: Any = build_model(seed=0)
    extra: dict[str, Any] = {}
    if vllm:
        import os

        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
            os.environ.setdefault(key, value)
        folder = tempfile.mkdtemp(prefix="bench_trl_model_")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        reset_peak()
        model = folder
        extra = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": 0.3,
            "vllm_max_model_length": 1024 + T,
            "model_init_kwargs": {"dtype": "bfloat16"},
        }
    peft_config = None
    if LORA_R:
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=T,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-6,
        gradient_checkpointing=True,
        bf16=DEVICE == "cuda",
        max_steps=warmup + steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=DEVICE != "cuda",
        **extra,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
        peft_config=peft_config,
    )
    base = reset_peak()
    sync()
    start = time.perf_counter()
    trainer.train()
    profiling.ProfilingContext._log_metrics = original_log  # type: ignore[method-assign]
    step_times = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    per_step: list[dict[str, float]] = []
    for i, end_mark in enumerate(marks):
        begin = marks[i - 1] if i else 0
        totals: dict[str, float] = {}
        for name, seconds in timings[begin:end_mark]:
            totals[name] = totals.get(name, 0.0) + seconds
        per_step.append(totals)

    def pick(key: str) -> float:
        return median([s.get(key, 0.0) for s in per_step[warmup:]])

    prepare = pick("GRPOTrainer._prepare_inputs")
    step = median(step_times[warmup:])
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    out = {
        "step_s": step,
        "step_times": step_times,
        "generate_s": pick("GRPOTrainer.vLLM.generate" if vllm else "GRPOTrainer.transformers.generate")
        or pick("GRPOTrainer._generate"),
        "score_s": pick("GRPOTrainer._calculate_rewards"),
        "train_s": step - prepare,
        "prepare_inputs_s": prepare,
        "mean_length": median(lengths[warmup:]) if lengths else float("nan"),
        "peak_gib": gib(peak()),
        "start_allocated_gib": gib(base),
        "profiling_names": sorted({n for n, _ in timings}),
    }
    if vllm:  # free the colocated engine's memory before the next run in this process
        import gc

        engine = getattr(trainer, "llm", None)
        if engine is not None:
            try:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                del trainer.llm, engine
                cleanup_dist_env_and_memory()
            except Exception as exc:  # noqa: BLE001 - best effort; the numbers are taken already
                log(f"vLLM cleanup: {exc!r}")
        gc.collect()
    del trainer, model
    return out


def _reset_accelerate() -> None:
    """Forget the previous run's Accelerator (each framework builds its own in this process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def table(tokens: list[int]) -> str:
    lines = [
        "",
        f"GRPO step, 64 completions (8 prompts x 8), bf16, batch 64, GA 1, shape {RESULTS.get('shape')}, "
        f"{'LoRA r=' + str(LORA_R) if LORA_R else 'full fine-tuning'} -- device: {RESULTS.get('device')}"
        + (f" -- {RESULTS['processes']} processes (tok/s: all of them)" if RESULTS.get("processes", 1) > 1 else ""),
        "",
        f"{'T':>5} {'framework':<22} {'step s':>7} {'generate':>9} {'score':>7} {'train':>7} {'tok/s':>8} {'peak GiB':>9} {'len':>6}",
    ]
    for T in tokens:
        runs = RESULTS["runs"].get(str(T), {})
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{T:>5} {name:<22} ERROR {r['error'][:70]}")
                continue
            tps = r.get("completions_per_s", 64 / r["step_s"]) * r["mean_length"]  # every process's tokens
            lines.append(
                f"{T:>5} {name:<22} {r['step_s']:>7.2f} {r['generate_s']:>9.2f} {r['score_s']:>7.3f} "
                f"{r['train_s']:>7.2f} {tps:>8.0f} {r['peak_gib']:>9.2f} {r['mean_length']:>6.0f}"
            )
        for peer in ("trl-vllm", "trl"):
            t = runs.get(peer, {})
            for name, o in runs.items():
                if not name.startswith("ours") or "error" in o or not t or "error" in t:
                    continue
                label = f"{peer} / {name}"
                lines.append(
                    f"{T:>5} {label:<22} {t['step_s'] / o['step_s']:>6.1f}x {t['generate_s'] / o['generate_s']:>8.1f}x "
                    f"{'':>7} {t['train_s'] / o['train_s']:>6.1f}x {'':>8} {(o['peak_gib'] / t['peak_gib'] if t['peak_gib'] else float('nan')):>8.2f}* "
                )
        for name, o in runs.items():
            if name.startswith("ours") and "error" not in o and o.get("compile_graphs"):
                graphs, seconds = o["compile_graphs"], o["compile_seconds"]
                late = graphs[-1] - graphs[min(1, len(graphs) - 1)]
                lines.append(
                    f"{T:>5} {name:<22} compile {seconds[-1]:.1f} s in all, {graphs[-1]:.0f} graphs, "
                    f"{late:.0f} compiled after step 2; non-finite steps {o.get('nonfinite_skipped', 0):.0f}"
                )
    lines.append("\n* peak memory ratio is ours / peer (lower is better); time ratios are peer / ours.")
    lines.append("  trl-vllm: TRL with vLLM colocated (its memory includes vLLM's 30 % reservation).")
    if RESULTS["errors"]:
        lines.append(f"{len(RESULTS['errors'])} error(s): see grpo_bench.json")
    return "\n".join(lines)


def _run_one(name: str, T: int, args: dict[str, Any], generator: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """One framework (or Engine variant) at T completion tokens; an error becomes ``{"error", "trace"}``."""
    global LORA_R
    LORA_R = args["lora"]
    _common.ACTIVE_SHAPE = args["shape"]
    try:
        _reset_accelerate()
        if name.startswith("ours"):
            return run_ours(T, args["steps"], args["warmup"], generator, args["train_chunk_rows"], overrides)
        return run_trl(T, args["trl_steps"] or args["steps"], args["trl_warmup"], vllm=name == "trl-vllm")
    except Exception as exc:
        log(traceback.format_exc())
        return {"error": repr(exc), "trace": traceback.format_exc()}


def _child(queue: Any, *run: Any) -> None:
    if sys.platform == "linux":  # die with the parent (a `timeout` that kills it must not leave a run on the GPU)
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    _show_run_notes()
    queue.put(_run_one(*run))


def _show_run_notes() -> None:
    """The Engine's INFO notes on stderr (e.g. what train_pass_tokens: auto picked)."""
    import logging

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("grpo_plugins").setLevel(logging.INFO)


def _run_in_child(*run: Any) -> dict[str, Any]:
    """:func:`_run_one` in a fresh process, so that each run starts on an empty GPU (compiled
    graphs, CUDA graph pools and vLLM's reservations of the run before cannot crowd it)."""
    import multiprocessing
    from queue import Empty

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, *run))
    child.start()
    while True:  # read before joining: a child blocks on exit until its result is read
        try:
            result = queue.get(timeout=10)
            break
        except Empty:
            if not child.is_alive() and queue.empty():
                return {"error": f"the run's process exited with code {child.exitcode} and no result"}
    child.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trl-steps", type=int, default=None, help="measured TRL steps (default --steps)")
    parser.add_argument("--trl-warmup", type=int, default=1)
    parser.add_argument("--frameworks", nargs="+", default=["ours", "trl"])
    parser.add_argument("--generator", default="static", help="the Engine's generator (static, transformers)")
    parser.add_argument("--generator-params", default="{}", help="JSON params of the generator")
    parser.add_argument("--train-chunk-rows", type=int, default=None, help="the Engine's train_chunk_rows")
    parser.add_argument(
        "--ours-variants",
        default=None,
        help='JSON {"name": {config overrides}, ...}: run the Engine once per entry (named "ours<name>") '
        'instead of once; e.g. \'{"": {}, " c16": {"train_chunk_rows": 16}}\'',
    )
    parser.add_argument("--shape", default="smol-vocab-0.4b", help="model shape: " + ", ".join(_common.SHAPES))
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="each run in its own process (default: on a single CUDA GPU), so no run inherits the memory of the one before",
    )
    args = parser.parse_args()
    import json

    _show_run_notes()
    main_process = int(os.environ.get("RANK", "0")) == 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if set(args.frameworks) != {"ours"}:
            parser.error("several processes (torchrun): only --frameworks ours")
        if torch.cuda.is_available():  # build_model() puts the model on the current device
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    global LORA_R
    LORA_R = args.lora
    _common.ACTIVE_SHAPE = args.shape
    RESULTS["shape"] = args.shape

    RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    RESULTS["torch"] = torch.__version__
    RESULTS["processes"] = int(os.environ.get("WORLD_SIZE", "1"))
    RESULTS["args"] = vars(args)
    generator = {"name": args.generator, "params": json.loads(args.generator_params)}
    variants: dict[str, dict[str, Any]] = json.loads(args.ours_variants) if args.ours_variants else {"": {}}
    runs: list[tuple[str, dict[str, Any]]] = []  # (name, the Engine's config overrides)
    for framework in args.frameworks:
        if framework == "ours":
            runs += [(f"ours{suffix}", overrides) for suffix, overrides in variants.items()]
        else:
            runs.append((framework, {}))
    isolate = args.isolate if args.isolate is not None else torch.cuda.is_available() and RESULTS["processes"] == 1
    for T in args.tokens:
        for name, overrides in runs:
            log(f"== {name} T={T}")
            run = (name, T, vars(args), generator, overrides)
            r = _run_in_child(*run) if isolate else _run_one(*run)
            if "error" in r:
                RESULTS["errors"].append({"run": f"{name} {T}", "error": r["error"], "trace": r.pop("trace", "")})
            RESULTS["runs"].setdefault(str(T), {})[name] = r
            if main_process:
                log(f"{name} T={T}: {r}")
                write_json(out_dir() / "grpo_bench.json", RESULTS)
            reset_peak()
    if main_process:
        print(table(args.tokens), flush=True)


if __name__ == "__main__":
    main()
