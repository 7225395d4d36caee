"""Unsloth's GRPO (``UnslothGRPOTrainer``, FastLanguageModel + LoRA) on the benchmark's workload,
for a memory comparison with ``bench/profile_memory.py`` and a speed comparison with
``bench/bench_grpo.py`` on the same GPU.

Run it with a Python whose environment holds Unsloth (measured with Unsloth 2026.10.9, TRL 1.15.0
and datasets 4.8.5; bench/README.md), the random model saved to an absolute path. Without
``--fast-inference`` the environment must not hold vLLM (``import unsloth`` imports it when it
finds it). Unsloth turns on ``mask_truncated_completions`` and ``epsilon_high: 0.28`` by itself in
a DAPO config; compare it with ``profile_memory.py``'s ``mask-truncated`` variant, or pass
``--match-ours`` to give Unsloth this project's values (the JSON's ``settings_used`` holds what
the trainer ended up with either way).

    HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1 \\
        python bench/bench_unsloth.py --lora 16 --tokens 256 --rows 64 --steps 3 --warmup 1 \\
        --out $OUT/unsloth_0.4b.json

For long completions (7B shape, 16 x 8192) train one row per forward+backward, as this project's
``train_chunk_rows: 1`` does, and save the random model once for the LoRA and the QLoRA run::

    python bench/bench_unsloth.py --shape qwen2.5-7b --model-dir $PWD/outputs/bench/models/qwen2.5-7b --save-only
    python bench/bench_unsloth.py --shape qwen2.5-7b --model-dir $PWD/outputs/bench/models/qwen2.5-7b --tokens 8192 --rows 16 \\
        --micro-rows 1 --steps 1 --warmup 0 [--load-in-4bit] --out $OUT/unsloth_7b.json

``--fast-inference`` generates with Unsloth's vLLM engine (``fast_inference=True``: vLLM holds
the base weights and the training model shares them; the trainer's ``use_vllm`` is on). The
environment then needs vLLM as well (bench/unsloth_fast_inference.sh sets one up)::

    python bench/bench_unsloth.py --fast-inference --shape qwen2.5-0.5b --tokens 1024 --rows 64 \\
        --steps 3 --warmup 1 --match-ours --out $OUT/unsloth_fast_0.5b.json

Prints and writes: median step seconds after ``--warmup``, TRL's profiling timers per step
(generation and ``_prepare_inputs``, so the rest is the training pass), the peak of torch's
allocator over the training steps (``max_memory_allocated``, as profile_memory.py reports; with
``--fast-inference`` it includes vLLM's KV cache, which is reported on its own too), the trainer
class (must be ``UnslothGRPOTrainer``: Unsloth falls back to TRL's silently when its patch
fails), whether vLLM generated, and the settings Unsloth ended up with. While it runs, a thread
appends torch's allocator counters every 10 s to ``<out>.progress.jsonl``, so a run stopped
before its end (Unsloth's 7B generation at 16 x 8192 took more than 20 minutes) still shows its
peak so far on the same measure.

Whatever fails (the import, the model load, vLLM's start, a step, a SIGTERM from ``timeout``),
the JSON is still written, with ``error``: the exception's type and message, the stage it
happened in, the innermost frame and the innermost frame in each of unsloth, unsloth_zoo, vllm,
trl and transformers, and the traceback; the exit status is then 1. The JSON is also rewritten
at each stage, so even a killed process leaves the stage it reached.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: GPU memory share of Unsloth's vLLM engine (weights, which training shares, plus KV cache and
#: CUDA graphs): the share bench_grpo.py gives TRL's colocated vLLM, far more KV cache than
#: 64 x ~1,100 tokens need even at 7B (about 4 GiB there).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.3

#: Libraries whose innermost frame an error report names (the frame that failed in each).
LIBRARIES = ("unsloth_zoo", "unsloth_compiled_cache", "unsloth", "vllm", "trl", "transformers", "peft", "torch")

#: TRL's profiling names (without the trainer class prefix) reported per step.
PROFILED = {
    "generate_s": ("vLLM.generate", "transformers.generate", "transformers.generate_batch"),
    "prepare_inputs_s": ("_prepare_inputs",),
    "score_s": ("_calculate_rewards",),
    "sync_weights_s": ("sync_weights",),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import bench._common as _common

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smol-vocab-0.4b", choices=sorted(_common.SHAPES), help="model shape")
    parser.add_argument("--lora", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-rows", type=int, default=0, help="rows per forward+backward (default: --rows, one micro-batch)")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument(
        "--load-in-fp8", action="store_true",
        help="Unsloth's float8 path (load_in_fp8=True: float8 weights through TorchAO; needs torchao, and vLLM with --fast-inference)",
    )
    parser.add_argument("--model-dir", default=None, help="an absolute folder for the random model: reused when it holds one")
    parser.add_argument("--save-only", action="store_true", help="build and save the model to --model-dir, then stop")
    parser.add_argument("--fast-inference", action="store_true", help="generate with Unsloth's vLLM engine (fast_inference=True)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="with --fast-inference: the GPU memory share of Unsloth's vLLM engine (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="with --fast-inference: sequences Unsloth's vLLM engine runs at once (default: Unsloth's own choice, "
        "from the memory left for the KV cache: 48 for 7B at 0.3 of an 80 GB card, fewer than the 64 completions)",
    )
    parser.add_argument(
        "--match-ours", action="store_true",
        help="pass this project's defaults where Unsloth changes TRL's: mask_truncated_completions=False, "
        "epsilon_high=0.2, optim adamw_torch, weight_decay 0, warmup_steps 0",
    )
    parser.add_argument("--out", default=None, help="the JSON to write (default: $OUT/unsloth.json)")
    args = parser.parse_args(argv)
    if args.micro_rows and args.rows % args.micro_rows:
        parser.error(f"--rows {args.rows} is not a multiple of --micro-rows {args.micro_rows}")
    if args.rows % 8:
        parser.error(f"--rows {args.rows} must be a multiple of 8 (8 completions per prompt)")
    if not 0 < args.gpu_memory_utilization < 1:
        parser.error("--gpu-memory-utilization must be between 0 and 1")
    if args.warmup < 0 or args.steps < 1:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def out_path_for(args: argparse.Namespace) -> Path | None:
    """The JSON to write; None for ``--save-only`` without ``--out`` (it only saves the model)."""
    from bench._common import out_dir

    if args.out:
        return Path(args.out)
    return None if args.save_only else out_dir() / "unsloth.json"


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The exception's type, message, innermost frame, innermost frame per library, and traceback."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(frame: traceback.FrameSummary) -> str:
        return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"

    library_frames: dict[str, str] = {}
    for frame in reversed(frames):
        parts = Path(frame.filename).parts
        for library in LIBRARIES:
            if library not in library_frames and library in parts:
                library_frames[library] = where(frame)
                break
    chained = exc.__cause__ or exc.__context__
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc)[:8000],
        "frame": where(frames[-1]) if frames else None,
        "library_frames": library_frames,
        "caused_by": f"{type(chained).__qualname__}: {str(chained)[:2000]}" if chained is not None else None,
        "traceback": text[-30000:],
    }


class Stopped(BaseException):
    """Raised from the SIGTERM handler (``timeout`` stops the run), so the JSON is still written; a
    BaseException, as KeyboardInterrupt is, so that the libraries' ``except Exception`` let it pass."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(f"stopped by signal {signal.Signals(signum).name} (the driver's timeout)")


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("unsloth", "unsloth_zoo", "vllm", "trl", "transformers", "torch", "peft", "datasets", "bitsandbytes", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def watch_memory(path: Path, every: float = 10.0) -> None:
    """Start a daemon thread appending allocator counters (GiB) to ``path`` every ``every`` s."""
    import threading

    import torch

    start = time.perf_counter()

    def run() -> None:
        while True:
            time.sleep(every)
            free, total = torch.cuda.mem_get_info()
            row = {
                "pid": os.getpid(),  # to find this process in nvidia-smi's per-process log
                "elapsed_s": round(time.perf_counter() - start, 1),
                "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                "device_used_gib": (total - free) / 2**30,  # every process on the GPU, not only this one
            }
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    if torch.cuda.is_available():
        threading.Thread(target=run, name="memory-watch", daemon=True).start()


def memory_now() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "device_used_gib": (total - free) / 2**30,
    }


def vllm_engine_facts(llm: Any) -> dict[str, Any]:
    """What Unsloth's vLLM engine reserved: its config, the KV cache's blocks and bytes, the runner."""
    import torch

    facts: dict[str, Any] = {"class": f"{type(llm).__module__}.{type(llm).__qualname__}"}
    engine = getattr(llm, "llm_engine", llm)
    config = getattr(engine, "vllm_config", None)
    cache = getattr(config, "cache_config", None)
    for key in ("gpu_memory_utilization", "num_gpu_blocks", "block_size", "cache_dtype", "enable_prefix_caching"):
        facts[key] = getattr(cache, key, None)
    scheduler = getattr(config, "scheduler_config", None)
    facts["max_num_seqs"] = getattr(scheduler, "max_num_seqs", None)
    facts["max_num_batched_tokens"] = getattr(scheduler, "max_num_batched_tokens", None)
    facts["max_model_len"] = getattr(getattr(config, "model_config", None), "max_model_len", None)
    compilation = getattr(config, "compilation_config", None)
    facts["compilation"] = {k: str(getattr(compilation, k, None)) for k in ("mode", "level", "cudagraph_mode")}
    facts["enforce_eager"] = getattr(getattr(config, "model_config", None), "enforce_eager", None)
    lora = getattr(config, "lora_config", None)
    facts["lora"] = {k: getattr(lora, k, None) for k in ("max_lora_rank", "max_loras")} if lora is not None else None
    try:
        runner = engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        facts["model_runner"] = f"{type(runner).__module__}.{type(runner).__qualname__}"
        seen: set[int] = set()
        total = 0

        def add(value: Any) -> None:
            nonlocal total
            if isinstance(value, torch.Tensor):
                if value.is_cuda and value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
            elif isinstance(value, (list, tuple)):
                for item in value:
                    add(item)
            elif isinstance(value, dict):
                for item in value.values():
                    add(item)

        add(getattr(runner, "kv_caches", None))
        facts["kv_cache_gib"] = total / 2**30 if total else None
    except Exception as exc:  # noqa: BLE001 - a fact we could not read is reported as such
        facts["model_runner"] = f"not reachable: {exc!r}"
    return facts


def run(args: argparse.Namespace, result: dict[str, Any], out_path: Path | None) -> None:
    """The benchmark; fills ``result`` as it goes (the caller writes it, also on failure)."""

    def save() -> None:
        if out_path is not None:
            from bench._common import write_json

            write_json(out_path, result)  # a killed process still leaves the stage it reached

    def stage(name: str) -> None:
        result["stage"] = name
        print(f"=== {time.strftime('%H:%M:%S')} {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    t0 = time.perf_counter()
    if args.fast_inference:
        # Unsloth sets these itself too; set here so they hold from the first vLLM import.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    stage("import unsloth")
    import unsloth  # noqa: F401  (must come before transformers, peft and trl: it patches them)

    result["versions"] = versions()
    result["unsloth"] = result["versions"]["unsloth"]
    try:
        import unsloth.import_fixes as fixes

        result["vllm_disabled_reason"] = getattr(fixes, "VLLM_DISABLED_REASON", None)
    except Exception:  # noqa: BLE001 - older Unsloth has no such module
        pass

    import bench._common as _common

    _common.ACTIVE_SHAPE = args.shape
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from unsloth import FastLanguageModel

    from bench._common import build_model, gib, length_reward, load_tokenizer, median, prompt_texts

    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # An absolute path, as Unsloth needs; a 7B model is built and saved once for several runs.
    folder = str(Path(args.model_dir).resolve()) if args.model_dir else tempfile.mkdtemp(prefix="bench_unsloth_model_")
    result["model_dir"] = folder
    if not (Path(folder) / "config.json").exists():
        stage("build and save the random model")
        tokenizer = load_tokenizer()
        model = build_model(seed=0, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # vLLM sizes its share from the memory free when it starts
    if args.save_only:
        print(f"saved the random model to {folder}", flush=True)
        result["saved_only"] = True
        return
    saved = AutoTokenizer.from_pretrained(folder)
    result["tokenizer_saved"] = {k: getattr(saved, k, None) for k in ("pad_token", "pad_token_id", "eos_token", "eos_token_id")}
    micro_rows = args.micro_rows or args.rows
    result["micro_rows"] = micro_rows

    if out_path is not None:  # from here on, also while vLLM starts
        watch_memory(out_path.with_name(out_path.stem + ".progress.jsonl"))
    stage("FastLanguageModel.from_pretrained")
    result["before_load"] = memory_now()
    if args.fast_inference:
        signal.signal(signal.SIGTERM, _stop)  # vLLM may install its own handlers while it starts
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=folder, max_seq_length=1024 + args.tokens, dtype=torch.bfloat16,
        load_in_4bit=args.load_in_4bit, fast_inference=args.fast_inference, max_lora_rank=args.lora,
        **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.fast_inference else {}),
        **({"load_in_fp8": True} if args.load_in_fp8 else {}),
        **({"max_num_seqs": args.max_num_seqs} if args.fast_inference and args.max_num_seqs else {}),
    )
    signal.signal(signal.SIGTERM, _stop)
    result["after_load"] = memory_now()
    result["tokenizer_used"] = {
        k: getattr(tokenizer, k, None) for k in ("pad_token", "pad_token_id", "eos_token", "eos_token_id", "padding_side")
    }
    engine = getattr(model, "vllm_engine", None)
    if args.fast_inference and engine is None:
        raise RuntimeError(
            "fast_inference=True but the model has no vllm_engine: Unsloth loaded it without vLLM "
            f"(vllm_disabled_reason: {result.get('vllm_disabled_reason')!r})"
        )
    stage("get_peft_model")
    model = FastLanguageModel.get_peft_model(
        model, r=args.lora, lora_alpha=2 * args.lora, random_state=0, use_gradient_checkpointing="unsloth",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )

    generate_calls: list[float] = []
    if engine is not None:
        result["vllm"] = vllm_engine_facts(engine)
        original_generate = engine.generate

        @functools.wraps(original_generate)  # Unsloth binds the caller's arguments to generate's signature
        def counted_generate(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return original_generate(*a, **k)
            finally:
                generate_calls.append(time.perf_counter() - started)

        engine.generate = counted_generate  # an instance attribute: Unsloth's per-call wrapper wraps it in turn

    # TRL's profiling timers (as bench_grpo.py reads them for TRL), grouped per optimizer step.
    import trl.extras.profiling as profiling

    timings: list[tuple[str, float]] = []
    original_log = profiling.ProfilingContext._log_metrics

    def record(self: Any, duration: float) -> None:
        timings.append((self.name, duration))
        original_log(self, duration)

    profiling.ProfilingContext._log_metrics = record  # type: ignore[method-assign]

    ends: list[float] = []
    marks: list[int] = []
    calls_at_end: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            marks.append(len(timings))
            calls_at_end.append(len(generate_calls))
            result["step_times"] = [b - a for a, b in zip([start, *ends[:-1]], ends)]
            print(f"=== {time.strftime('%H:%M:%S')} step {len(ends)} ended: {result['step_times'][-1]:.2f} s", flush=True)
            save()
            if len(ends) == args.warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # the peak of the measured steps only

    import datasets

    match: dict[str, Any] = {}
    if args.match_ours:
        match = {"mask_truncated_completions": False, "epsilon_high": 0.2, "optim": "adamw_torch", "weight_decay": 0.0, "warmup_steps": 0}
    fast: dict[str, Any] = {}
    if args.fast_inference:
        fast = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.gpu_memory_utilization}
    result["passed_settings"] = {**match, **fast}
    stage("GRPOTrainer")
    cuda = torch.cuda.is_available()  # the CPU only in the tests' dry run
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_unsloth_"), per_device_train_batch_size=micro_rows,
        gradient_accumulation_steps=args.rows // micro_rows, num_generations=8, max_completion_length=args.tokens, temperature=1.0,
        beta=0.0, loss_type="dapo", learning_rate=1e-6, bf16=cuda, use_cpu=not cuda, max_steps=args.warmup + args.steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, **match, **fast,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[length_reward], args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompt_texts(256)}), callbacks=[StepTimer()],
    )
    result["trainer"] = type(trainer).__name__
    used = trainer.args
    result["settings_used"] = {k: getattr(used, k, None) for k in (
        "mask_truncated_completions", "epsilon", "epsilon_high", "loss_type", "beta", "gradient_checkpointing",
        "use_vllm", "vllm_mode", "vllm_importance_sampling_correction", "temperature", "top_p", "top_k",
        "max_completion_length", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
        "learning_rate", "optim", "weight_decay", "warmup_steps", "lr_scheduler_type", "max_grad_norm", "bf16",
        "scale_rewards", "steps_per_generation")}
    generation = getattr(trainer, "vllm_generation", None)
    result["trainer_vllm_is_unsloth_engine"] = (
        getattr(generation, "llm", None) is engine if engine is not None else None
    )

    stage("train")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        profiling.ProfilingContext._log_metrics = original_log  # type: ignore[method-assign]
        # What the steps so far measured, also when a step failed or the run was stopped.
        steps = [b - a for a, b in zip([start, *ends[:-1]], ends)]
        measured = slice(args.warmup, None)
        per_step: list[dict[str, float]] = []
        for i, end_mark in enumerate(marks):
            totals: dict[str, float] = {}
            for name, seconds in timings[(marks[i - 1] if i else 0):end_mark]:
                totals[name] = totals.get(name, 0.0) + seconds
            per_step.append(totals)

        def pick(suffixes: tuple[str, ...]) -> float | None:
            values = [sum(v for n, v in s.items() if n.split(".", 1)[-1] in suffixes) for s in per_step[measured]]
            return median(values) if values and any(values) else None

        result["step_s"] = median(steps[measured]) if len(steps) > args.warmup else None
        result["step_times"] = steps
        for key, suffixes in PROFILED.items():
            result[key] = pick(suffixes)
        if result["step_s"] is not None and result["prepare_inputs_s"] is not None:
            result["train_s"] = result["step_s"] - result["prepare_inputs_s"]  # the rest of the step, as for TRL
        result["profiling_per_step"] = per_step
        per_call = [calls_at_end[i] - (calls_at_end[i - 1] if i else 0) for i in range(len(calls_at_end))]
        result["vllm_generate_calls_per_step"] = per_call
        result["vllm_generate_calls"] = len(generate_calls)
        result["vllm_generate_seconds"] = generate_calls
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        result["mean_length"] = median(lengths[measured]) if len(lengths) > args.warmup else None
        result["losses"] = [h.get("loss") for h in trainer.state.log_history if "loss" in h]
        if torch.cuda.is_available():
            result["peak_gib"] = gib(torch.cuda.max_memory_allocated())
            result["reserved_peak_gib"] = gib(torch.cuda.max_memory_reserved())
            result["end"] = memory_now()
        if engine is not None:
            try:
                import unsloth_zoo.vllm_utils as zoo

                result["merged_rollout"] = {"mode": zoo._merged_rollout_mode(), **dict(zoo._MERGED_ROLLOUT_STATS)}
            except Exception as exc:  # noqa: BLE001 - reported, not needed
                result["merged_rollout"] = f"unknown: {exc!r}"


def checks(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """What makes these numbers not Unsloth's fast path (empty when all is well)."""
    if result.get("saved_only"):
        return []
    failed = []
    if result.get("trainer") != "UnslothGRPOTrainer":
        failed.append(f"the trainer is {result.get('trainer')!r}, not UnslothGRPOTrainer: Unsloth's patch did not apply")
    if args.fast_inference:
        if not result.get("vllm"):
            failed.append("the model has no vllm_engine")
        elif not result.get("vllm_generate_calls"):
            failed.append("Unsloth's vLLM engine never generated")
        if result.get("trainer_vllm_is_unsloth_engine") is False:
            failed.append("the trainer built a vLLM engine of its own instead of using Unsloth's")
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_path = out_path_for(args)
    result: dict[str, Any] = {
        "framework": "unsloth-fast-inference" if args.fast_inference else "unsloth", "pid": os.getpid(),
        "fast_inference": args.fast_inference, "shape": args.shape, "lora": args.lora, "tokens": args.tokens,
        "rows": args.rows, "micro_rows": args.micro_rows or args.rows, "load_in_4bit": args.load_in_4bit,
        "load_in_fp8": args.load_in_fp8,
        "steps": args.steps, "warmup": args.warmup, "match_ours": args.match_ours,
        "gpu_memory_utilization": args.gpu_memory_utilization if args.fast_inference else None,
        "argv": sys.argv[1:] if argv is None else argv, "stage": None,
    }
    signal.signal(signal.SIGTERM, _stop)
    from bench._common import write_json

    status = 0
    try:
        run(args, result, out_path)
        result["stage"] = "done"
    except BaseException as exc:  # noqa: BLE001 - every failure ends in the JSON, then the exit status says so
        result["error"] = describe_error(exc)
        error = result["error"]
        print(
            f"\n=== FAILED in stage {result.get('stage')!r}: {error['type']}: {error['message'][:2000]}\n"
            f"=== at {error['frame']}\n"
            + "".join(f"=== in {library}: {frame}\n" for library, frame in error["library_frames"].items()),
            file=sys.stderr, flush=True,
        )
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        status = 1
    failed = checks(args, result) if "error" not in result else []
    result["checks_failed"] = failed
    if out_path is not None:
        write_json(out_path, result)
    summary = {k: result.get(k) for k in (
        "framework", "shape", "tokens", "rows", "trainer", "stage", "step_s", "generate_s", "train_s", "peak_gib",
        "mean_length", "vllm_generate_calls")}
    print(json.dumps(summary, default=str), flush=True)
    for message in failed:
        print(f"WARNING: {message}; these are not Unsloth's fast-path numbers", flush=True)
    if out_path is not None:
        print(f"wrote {out_path}", flush=True)
    return status or (2 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
