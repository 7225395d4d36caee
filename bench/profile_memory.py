"""Where a GRPO step's GPU memory goes, phase by phase, for each memory setting.

    python bench/profile_memory.py --shape smol-vocab-0.4b --lora 16 --tokens 256 --rows 64 \\
        --steps 3 --warmup 1 --variants default offload release all --out $OUT/mem_0.4b.json

Runs this project's Engine on bench_grpo.py's workload (random-initialised model of ``--shape``,
SmolLM2 tokenizer, 8 generations per prompt, ``--rows`` completions per step in one micro-batch,
beta 0, dapo, gradient checkpointing on, bf16, static generator sampling the full ``--tokens``)
once per variant (a named set of config overrides, see VARIANTS; ``--variants-json`` adds
more). For every call of every phase it records, with ``torch.cuda.reset_peak_memory_stats``
before the phase:

- ``generate`` (prefill + decode: KV cache, CUDA-graph pool), ``reward``, ``old_logps`` /
  ``ref_logps`` (no-grad forwards, when the run needs them), ``train`` (one micro-step: forward
  + backward, activations, log-prob chunks, gradients), ``optimizer`` (clip, AdamW, zero_grad);
- allocated before / peak / after, reserved before / peak / after, the fragmentation at the end
  (reserved - allocated), allocator events during the phase (cudaMalloc / cudaFree calls,
  alloc retries: a retry frees the cache and stalls the step), wall time (synchronised), host time
  (until the phase returned), the process's CPU time (user + system, and system alone) and the
  load average: a host-bound phase has CPU time equal to its wall time (so may one that spin-waits
  for the GPU).

Plus the steady parts, in bytes, counted from the tensors themselves: frozen base weights
(16-bit, or quantised storage and quantisation state), trainable weights, gradients at the end
of the accumulation window, AdamW state, float32 master copies, the static generator's KV caches.
Per optimizer step: the step's wall time and its phase times, to expose drift across steps at
fixed shapes (an eager LoRA training pass was once seen going from 0.47 s to 2.5 s between steps 2-3
and 4-5); ``--torch-profile DIR`` writes the op tables of the first and last measured training
pass, so a slower kernel (or more host time) shows by name; with ``--profile-slow FACTOR`` it
profiles every measured pass instead and keeps the tables of each one slower than FACTOR x the
median before it, next to those of the last normal pass (the drift is rare and comes unannounced). ``--snapshot DIR`` records the allocator history of the last measured step
(``torch.cuda.memory._record_memory_history``) and dumps it for https://pytorch.org/memory_viz.

Without CUDA (``--tiny``, or no GPU) it runs a tiny model with a character tokenizer on the CPU:
every field is written, the device-memory numbers are 0, the tensor byte counts and times are
real. Writes ``--out`` (JSON, atomically) and prints a table per variant.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as _common  # noqa: E402
from bench._common import gib, length_reward, median, prompt_texts, write_json  # noqa: E402

#: Named config overrides (the Engine's settings), applied on top of the workload's config.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the project's defaults (on a GPU: compiled layers for LoRA too)
    "eager": {"compile_layers": False},
    "offload": {"activation_offload": True},
    "chunk16": {"train_chunk_rows": 16},
    "chunk1": {"train_chunk_rows": 1},
    "release": {"generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True}}},
    "logprob256": {"logprob_chunk_size": 256},
    "nomerge": {"generator": {"name": "static", "params": {"ignore_eos": True, "merge_weights": False}}},
    "all": {
        "activation_offload": True, "train_chunk_rows": 16, "logprob_chunk_size": 256,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True}},
    },
    "lean": {  # "all" without the merged decoding copy: the smallest LoRA footprint
        "activation_offload": True, "train_chunk_rows": 16, "logprob_chunk_size": 256,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "merge_weights": False}},
    },
    "long": {  # 16 x 8192 at 7B: one row per forward+backward, everything else small
        "activation_offload": True, "train_chunk_rows": 1, "logprob_chunk_size": 512,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True}},
    },
    "lean-eager": {  # "lean" with eager layers (what "lean" was before compiled LoRA became the default)
        "compile_layers": False, "activation_offload": True, "train_chunk_rows": 16, "logprob_chunk_size": 256,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "merge_weights": False}},
    },
    "lean-nooffload": {  # "lean" without activation offload: smaller row chunks instead
        "train_chunk_rows": 8, "logprob_chunk_size": 256,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "merge_weights": False}},
    },
    "long-lean": {  # "long" without the merged decoding copy (a full copy of the projection weights at 7B)
        "activation_offload": True, "train_chunk_rows": 1, "logprob_chunk_size": 512,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "merge_weights": False}},
    },
    "long-lean8": {  # "long-lean" decoding 8 rows at a time: half the KV cache, about twice the generation time
        "activation_offload": True, "train_chunk_rows": 1, "logprob_chunk_size": 512,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "merge_weights": False,
                                                    "max_batch_rows": 8}},
    },
    "qlora": {"load_in_4bit": True},
    "qlora-long": {
        "load_in_4bit": True, "activation_offload": True, "train_chunk_rows": 1, "logprob_chunk_size": 512,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True}},
    },
    "qlora-long8": {  # "qlora-long" decoding 8 rows at a time
        "load_in_4bit": True, "activation_offload": True, "train_chunk_rows": 1, "logprob_chunk_size": 512,
        "generator": {"name": "static", "params": {"ignore_eos": True, "release_cache": True, "max_batch_rows": 8}},
    },
    "qlora8": {"load_in_8bit": True},
    "mask-truncated": {"mask_truncated_completions": True, "epsilon_high": 0.28},  # Unsloth's silent changes
}

CUDA = torch.cuda.is_available()


def log(msg: str) -> None:
    print(msg, flush=True)


# -- measuring ----------------------------------------------------------------------------------


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _mem() -> dict[str, float]:
    if not CUDA:
        return {"allocated": 0, "reserved": 0, "retries": 0, "device_allocs": 0, "device_frees": 0}
    stats = torch.cuda.memory_stats()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "retries": stats.get("num_alloc_retries", 0),
        "device_allocs": stats.get("num_device_alloc", 0),
        "device_frees": stats.get("num_device_free", 0),
    }


class GcClock:
    """Seconds Python's garbage collector has run, by generation (through ``gc.callbacks``): a
    training pass that is slow on the host with no op to show for it may be a full collection."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start


GC_CLOCK = GcClock()


class Recorder:
    """Wraps phase functions; keeps one record per call."""

    def __init__(
        self,
        profile_steps: tuple[int, ...] = (),
        profile_dir: Path | None = None,
        label: str = "",
        slow_factor: float | None = None,
        warmup: int = 0,
    ) -> None:
        self.calls: list[dict[str, Any]] = []
        self.step = 0  # optimizer steps done (the phase's step is step + 1)
        self.profile_steps, self.profile_dir, self.label = profile_steps, profile_dir, label
        # --profile-slow: profile every measured training pass; keep the tables of one that takes
        # slow_factor x the median of the passes before it, with those of the last normal pass.
        self.slow_factor, self.warmup = slow_factor, warmup
        self._last_normal: tuple[Any, int] | None = None
        self.slow_steps: list[int] = []

    def _profiles(self, phase: str) -> bool:
        if phase != "train" or self.profile_dir is None:
            return False
        if self.slow_factor is not None and self.step + 1 > self.warmup:
            return True
        return self.step + 1 in self.profile_steps

    def _keep_if_slow(self, profiler: Any, wall: float) -> None:
        """--profile-slow: write ``profiler``'s tables (and the last normal pass's) when this
        training pass is slow against the median of the measured passes before it."""
        before = [c["wall_s"] for c in self.calls if c["phase"] == "train" and c["step"] > self.warmup]
        assert self.slow_factor is not None
        if len(before) >= 2 and wall > self.slow_factor * median(before):
            self._write_profile(profiler, "train", tag="slow")
            if self._last_normal is not None:
                normal, step = self._last_normal
                self._write_profile(normal, "train", tag="normal", step=step)
            self.slow_steps.append(self.step + 1)
        else:
            self._last_normal = (profiler, self.step + 1)

    def wrap(self, phase: str, fn: Any, before_call: Any = None) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            extra = before_call() if before_call is not None else {}
            _sync()
            start = _mem()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            profiler = None
            if self._profiles(phase):
                activities = [torch.profiler.ProfilerActivity.CPU]
                if CUDA:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities)
                profiler.__enter__()
            t0, times0, gc0 = time.perf_counter(), os.times(), list(GC_CLOCK.seconds)
            out = fn(*args, **kwargs)
            host = time.perf_counter() - t0
            _sync()
            wall = time.perf_counter() - t0
            times1, gc1 = os.times(), list(GC_CLOCK.seconds)
            if profiler is not None:
                profiler.__exit__(None, None, None)
                if self.step + 1 in self.profile_steps:
                    self._write_profile(profiler, phase)
                if self.slow_factor is not None:
                    self._keep_if_slow(profiler, wall)
            end = _mem()
            self.calls.append(
                {
                    "phase": phase,
                    "step": self.step + 1,
                    "wall_s": wall,
                    "host_s": host,
                    # CPU seconds of this process (all its threads): host_s well above cpu_s means the
                    # process was not running (preempted, or asleep in a wait). The converse proves
                    # less: a CUDA synchronisation spin-waits by default, so GPU waits count as CPU.
                    "cpu_s": (times1.user - times0.user) + (times1.system - times0.system),
                    # In the kernel (page faults, pinning, driver calls): a slow pass with high
                    # system time points at the OS, one with high user time at Python/launches.
                    "cpu_system_s": times1.system - times0.system,
                    "load_1min": os.getloadavg()[0],
                    "allocated_before_gib": gib(start["allocated"]),
                    "allocated_peak_gib": gib(torch.cuda.max_memory_allocated()) if CUDA else 0.0,
                    "allocated_after_gib": gib(end["allocated"]),
                    "reserved_before_gib": gib(start["reserved"]),
                    "reserved_peak_gib": gib(torch.cuda.max_memory_reserved()) if CUDA else 0.0,
                    "reserved_after_gib": gib(end["reserved"]),
                    "fragmentation_after_gib": gib(end["reserved"] - end["allocated"]),
                    "device_allocs": end["device_allocs"] - start["device_allocs"],
                    "device_frees": end["device_frees"] - start["device_frees"],
                    "alloc_retries": end["retries"] - start["retries"],
                    "gc_collections": sum(s["collections"] for s in gc.get_stats()),
                    # Inside the timed call: all collections, and the full (generation-2) ones.
                    "gc_s": sum(gc1) - sum(gc0),
                    "gc_full_s": gc1[2] - gc0[2],
                    **extra,
                }
            )
            return out

        return wrapper


    def _write_profile(self, profiler: Any, phase: str, tag: str = "", step: int | None = None) -> None:
        """The op tables of one profiled call (by device time and by self CPU time)."""
        assert self.profile_dir is not None
        step = self.step + 1 if step is None else step
        averages = profiler.key_averages()
        device_key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
        text = f"== {self.label} {phase} step {step}{' (' + tag + ')' if tag else ''}: by device time\n"
        text += averages.table(sort_by=device_key, row_limit=30)
        text += f"\n== {self.label} {phase} step {step}: by self CPU time\n"
        text += averages.table(sort_by="self_cpu_time_total", row_limit=30)
        path = self.profile_dir / f"profile_{self.label}_{phase}_step{step}{'_' + tag if tag else ''}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _quant_state_tensors(model: Any) -> list[torch.Tensor]:
    """The absmax / code tensors bitsandbytes keeps next to 4-bit weights."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is None:
            continue
        for name in ("absmax", "code"):
            if isinstance(getattr(state, name, None), torch.Tensor):
                out.append(getattr(state, name))
        nested = getattr(state, "state2", None)
        if nested is not None:
            out += [t for t in (getattr(nested, "absmax", None), getattr(nested, "code", None)) if isinstance(t, torch.Tensor)]
    return out


def static_parts(engine: Any) -> dict[str, float]:
    """GiB held by the model, optimizer and generator, counted from their tensors."""
    model = engine.unwrapped
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    master = engine.master.params if engine.master is not None else []
    masters = [m for m, p in zip(master, engine.trainable) if m is not p]
    decoder = getattr(engine.generator, "_decoder", None)
    cache: list[torch.Tensor] = []
    for graph in getattr(decoder, "_graphs", {}).values():
        for st in graph.states:
            cache += list(st.k_cache) + list(st.v_cache)
            cache += [t for t in vars(st).values() if isinstance(t, torch.Tensor)]
    return {
        "frozen_weights_gib": gib(tensor_bytes(frozen)),
        "quant_state_gib": gib(tensor_bytes(_quant_state_tensors(model))),
        "trainable_weights_gib": gib(tensor_bytes(trainable)),
        "trainable_params": sum(p.numel() for p in trainable),
        "frozen_params": sum(p.numel() for p in frozen),
        "optimizer_state_gib": gib(tensor_bytes(state)),
        "master_copies_gib": gib(tensor_bytes(masters)),
        "generator_cache_gib": gib(tensor_bytes(cache)),
        "generator_graphs": len(getattr(decoder, "_graphs", {})),
    }


# -- the workload ---------------------------------------------------------------------------------


def _tokenizer(tiny: bool) -> Any:
    if not tiny:
        return _common.load_tokenizer()
    from transformers import AutoTokenizer

    from grpo_plugins.testing import build_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(Path(tempfile.mkdtemp(prefix="tok_")))))
    tokenizer.padding_side = "left"
    return tokenizer


def _model(tiny: bool, dtype: torch.dtype, on_device: bool = True) -> Any:
    """The random model; ``on_device=False`` builds it in CPU memory, as a checkpoint is read,
    so that a quantised variant's setup peak is the engine's (it quantises layer by layer on
    the device), not that of a 16-bit copy this script put there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = _common.model_shape()
    if tiny:
        from grpo_plugins.testing.tiny import tiny_vocab_size

        shape.update(vocab_size=tiny_vocab_size(), max_position_embeddings=2048)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA and on_device else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = None
    return model


def config_for(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    rows = args.rows
    config: dict[str, Any] = {
        "task": None,
        "dtype": "bfloat16" if CUDA else "float32",
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": 1,
        "num_generations": min(8, rows),
        "max_completion_length": args.tokens,
        "max_prompt_length": 512,
        "temperature": 1.0,
        "beta": args.beta,
        "loss_type": "dapo",
        "learning_rate": 1e-6,
        "gradient_checkpointing": True,
        "compile_layers": None,  # the project's default; the "eager" variants set False
        "max_steps": args.warmup + args.steps,
        "logging_steps": 1,
        "save_steps": 10**6,
        "report_to": [],
        "generator": {"name": "static", "params": {"ignore_eos": True}},
        "output_dir": tempfile.mkdtemp(prefix="profile_memory_"),
        "seed": 0,
        "lora": {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"} if args.lora else None,
    }
    if not CUDA:
        config["generator"] = {"name": "static", "params": {"ignore_eos": True}}
    return {**config, **overrides}


def run_variant(args: argparse.Namespace, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    import datasets

    from grpo_plugins.engine import Engine

    tiny = args.tiny or not CUDA
    config = config_for(args, overrides)
    dtype = torch.bfloat16 if CUDA else torch.float32
    dataset = datasets.Dataset.from_dict({"prompt": prompt_texts(max(64, args.rows))})
    _common.reset_peak()
    quantized = bool(config.get("load_in_4bit") or config.get("load_in_8bit"))
    model = _model(tiny, dtype, on_device=not quantized)
    engine = Engine(config, model=model, tokenizer=_tokenizer(tiny), rewards=[length_reward], dataset=dataset)
    profile_dir = Path(args.torch_profile) if args.torch_profile else None
    rec = Recorder(
        (args.warmup + 1, args.warmup + args.steps) if args.slow_factor is None else (),
        profile_dir, f"{args.shape}_{name}", slow_factor=args.slow_factor, warmup=args.warmup,
    )
    _sync()
    t0 = time.perf_counter()
    engine._setup()
    setup_s = time.perf_counter() - t0
    after_setup = _mem()
    setup_peak = torch.cuda.max_memory_allocated() if CUDA else 0
    if not args.gc_freeze:
        engine.heap.freeze = lambda: None  # type: ignore[method-assign]

    # Instrument the phases (the objects exist once the engine is set up).
    rollouts = engine.rollouts
    engine.generator.generate = rec.wrap("generate", engine.generator.generate)
    rollouts._score = rec.wrap("reward", rollouts._score)
    batch_logps = rollouts.batch_logps
    labels: list[str] = []

    def labelled_batch_logps(*a: Any, **k: Any) -> Any:
        phase = labels.pop(0) if labels else "logps"
        return rec.wrap(phase, batch_logps)(*a, **k)

    rollouts.batch_logps = labelled_batch_logps
    add_logps = rollouts._add_logps

    def add_logps_labelled(rollout: Any, steps: Any) -> None:
        labels[:] = (["old_logps"] if not engine.plan.on_policy else []) + (["ref_logps"] if config["beta"] else [])
        add_logps(rollout, steps)

    rollouts._add_logps = add_logps_labelled
    engine.update.micro_step = rec.wrap("train", engine.update.micro_step)
    grads_gib: list[float] = []

    def grads_now() -> dict[str, float]:
        g = gib(tensor_bytes(p.grad for p in engine.trainable if p.grad is not None))
        grads_gib.append(g)
        return {"gradients_gib": g}

    optimizer_step = rec.wrap("optimizer", engine._optimizer_step, before_call=grads_now)
    step_ends: list[float] = []
    snapshot_at = args.warmup + args.steps if args.snapshot else None

    def counted_step(*a: Any, **k: Any) -> Any:
        out = optimizer_step(*a, **k)
        _sync()
        step_ends.append(time.perf_counter())
        rec.step += 1
        if snapshot_at is not None and CUDA and rec.step == snapshot_at - 1:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        return out

    engine._optimizer_step = counted_step  # type: ignore[method-assign]

    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    _sync()
    start = time.perf_counter()
    try:
        result = engine._run(None)
    finally:
        if snapshot_at is not None and CUDA:
            path = Path(args.snapshot) / f"snapshot_{args.shape}_{name}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
    run_peak = torch.cuda.max_memory_allocated() if CUDA else 0
    run_reserved_peak = torch.cuda.max_memory_reserved() if CUDA else 0
    parts = static_parts(engine)
    engine._teardown()

    step_times = [b - a for a, b in zip([start, *step_ends[:-1]], step_ends)]
    measured = [c for c in rec.calls if c["step"] > args.warmup]
    phases: dict[str, dict[str, float]] = {}
    for phase in ("generate", "reward", "old_logps", "ref_logps", "train", "optimizer"):
        calls = [c for c in measured if c["phase"] == phase]
        if not calls:
            continue
        phases[phase] = {
            "calls": len(calls),
            **{k: median([c[k] for c in calls]) for k in ("wall_s", "host_s")},
            **{k: max(c[k] for c in calls) for k in (
                "allocated_before_gib", "allocated_peak_gib", "allocated_after_gib", "reserved_peak_gib",
                "fragmentation_after_gib", "alloc_retries", "device_allocs", "device_frees",
            )},
            "above_before_gib": max(c["allocated_peak_gib"] - c["allocated_before_gib"] for c in calls),
        }
    per_step = []
    for s, seconds in enumerate(step_times, start=1):
        calls = [c for c in rec.calls if c["step"] == s]
        per_step.append(
            {
                "step": s,
                "step_s": seconds,
                **{f"{p}_s": sum(c["wall_s"] for c in calls if c["phase"] == p) for p in ("generate", "train", "optimizer")},
                "train_host_s": sum(c["host_s"] for c in calls if c["phase"] == "train"),
                "train_cpu_s": sum(c["cpu_s"] for c in calls if c["phase"] == "train"),
                "train_cpu_system_s": sum(c["cpu_system_s"] for c in calls if c["phase"] == "train"),
                "train_gc_s": sum(c["gc_s"] for c in calls if c["phase"] == "train"),
                "train_gc_full_s": sum(c["gc_full_s"] for c in calls if c["phase"] == "train"),
                "gc_s": sum(c["gc_s"] for c in calls),
                "load_1min": max((c["load_1min"] for c in calls), default=0.0),
                "alloc_retries": sum(c["alloc_retries"] for c in calls),
                "device_allocs": sum(c["device_allocs"] for c in calls),
                "peak_gib": max((c["allocated_peak_gib"] for c in calls), default=0.0),
            }
        )
    out = {
        "variant": name,
        "overrides": overrides,
        "config": {k: v for k, v in config.items() if k != "output_dir"},
        "setup_s": setup_s,
        "after_setup_allocated_gib": gib(after_setup["allocated"]),
        "setup_peak_gib": gib(setup_peak),
        # Each phase resets the peak counters, so the run's peak is the largest phase peak.
        "peak_gib": max([gib(run_peak), *(c["allocated_peak_gib"] for c in measured)]),
        "reserved_peak_gib": max([gib(run_reserved_peak), *(c["reserved_peak_gib"] for c in measured)]),
        "step_s": median(step_times[args.warmup:]),
        "step_times": step_times,
        "parts": {**parts, "gradients_gib": max(grads_gib, default=0.0)},
        "phases": phases,
        "per_step": per_step,
        "slow_steps": rec.slow_steps,  # --profile-slow: the steps whose training pass was profiled as slow
        "calls": rec.calls,
        "losses": [h.get("loss") for h in result.history],
        "mean_length": median([h.get("completions/mean_length", float("nan")) for h in result.history]),
    }
    import shutil

    shutil.rmtree(config["output_dir"], ignore_errors=True)
    del engine, result, model
    _common.reset_peak()
    return out


def table(r: dict[str, Any]) -> str:
    p = r["parts"]
    lines = [
        f"== {r['variant']}: step {r['step_s']:.2f} s (steps: {', '.join(f'{t:.2f}' for t in r['step_times'])}), "
        f"peak {r['peak_gib']:.2f} GiB allocated / {r['reserved_peak_gib']:.2f} reserved, setup {r['setup_s']:.0f} s",
        f"   weights: frozen {p['frozen_weights_gib']:.2f} (+quant state {p['quant_state_gib']:.2f}), trainable "
        f"{p['trainable_weights_gib']:.3f}, grads {p['gradients_gib']:.3f}, AdamW {p['optimizer_state_gib']:.3f}, "
        f"masters {p['master_copies_gib']:.3f}, generator cache {p['generator_cache_gib']:.2f} GiB",
        f"   {'phase':<10} {'wall s':>7} {'host s':>7} {'before':>7} {'peak':>7} {'+peak':>7} {'after':>7} "
        f"{'resv pk':>7} {'frag':>6} {'mallocs':>7} {'retries':>7}",
    ]
    for phase, s in r["phases"].items():
        lines.append(
            f"   {phase:<10} {s['wall_s']:>7.3f} {s['host_s']:>7.3f} {s['allocated_before_gib']:>7.2f} "
            f"{s['allocated_peak_gib']:>7.2f} {s['above_before_gib']:>7.2f} {s['allocated_after_gib']:>7.2f} "
            f"{s['reserved_peak_gib']:>7.2f} {s['fragmentation_after_gib']:>6.2f} {s['device_allocs']:>7.0f} "
            f"{s['alloc_retries']:>7.0f}"
        )
    drift = ", ".join(f"{s['train_s']:.2f}" for s in r["per_step"])
    lines.append(f"   train pass per step (s): {drift}")
    cpu = ", ".join(f"{s['train_cpu_s']:.2f} ({s['train_cpu_system_s']:.2f})" for s in r["per_step"])
    load = ", ".join(f"{s['load_1min']:.1f}" for s in r["per_step"])
    lines.append(f"   its CPU time (s; in the kernel): {cpu}; load average: {load}")
    collector = ", ".join(f"{s['train_gc_s']:.3f} ({s['train_gc_full_s']:.3f})" for s in r["per_step"])
    lines.append(f"   garbage collection in it (s; full collections): {collector}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", default="smol-vocab-0.4b",
        help="model shape (default: Qwen2-0.5B's with SmolLM2's vocabulary): " + ", ".join(_common.SHAPES),
    )
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank on all linear layers (0: full fine-tuning)")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens (sampled to the full length)")
    parser.add_argument("--rows", type=int, default=64, help="completions per step (one micro-batch)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference pass)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before (compilation, first captures)")
    parser.add_argument("--variants", nargs="+", default=["default"], help="names from: " + ", ".join(VARIANTS))
    parser.add_argument("--variants-json", default=None, help='more variants: JSON {"name": {config overrides}}')
    parser.add_argument("--snapshot", default=None, help="folder for an allocator snapshot of the last step")
    parser.add_argument(
        "--torch-profile", default=None,
        help="folder for torch.profiler op tables of the train pass of the first and the last measured step (step-time drift)",
    )
    parser.add_argument(
        "--profile-slow", dest="slow_factor", type=float, default=None, metavar="FACTOR",
        help="with --torch-profile: profile every measured train pass and keep the op tables of any that "
        "takes FACTOR x the median of the passes before it, with those of the last normal pass",
    )
    parser.add_argument(
        "--no-gc-freeze", dest="gc_freeze", action="store_false",
        help="leave the heap to Python's collector as it is (the engine freezes it after setup and "
        "after the first step, grpo_plugins/heap.py): shows what the freeze does to the step times",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model and tokenizer (CPU dry run)")
    parser.add_argument("--out", default=None, help="the JSON to write (default $OUT/profile_memory.json)")
    args = parser.parse_args(argv)
    _common.ACTIVE_SHAPE = args.shape
    _common.TINY = args.tiny or not CUDA
    variants = dict(VARIANTS)
    if args.variants_json:
        variants.update(json.loads(args.variants_json))
    unknown = [v for v in args.variants if v not in variants]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(variants)}")
    if args.slow_factor is not None and not args.torch_profile:
        parser.error("--profile-slow needs --torch-profile DIR (where the op tables go)")
    out_path = Path(args.out) if args.out else _common.out_dir() / "profile_memory.json"
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "pid": os.getpid(),  # to find this process in nvidia-smi's per-process log
        "torch": torch.__version__,
        "args": vars(args),
        "runs": {},
        "errors": {},
    }
    for name in args.variants:
        log(f"== {name} {time.strftime('%H:%M:%S')}")
        try:
            from accelerate.state import AcceleratorState, GradientState, PartialState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            PartialState._reset_state()
            results["runs"][name] = run_variant(args, name, variants[name])
            log(table(results["runs"][name]))
        except Exception as exc:  # noqa: BLE001 - one variant's failure (e.g. OOM) must not lose the others
            import traceback

            results["errors"][name] = traceback.format_exc()
            log(f"{name}: {exc!r}")
            _common.reset_peak()
        write_json(out_path, results)
    return results


if __name__ == "__main__":
    main()
