"""What ``torch.compile`` costs a run, cold and on a second run on the same machine.

    python bench/profile_compile.py                      # LoRA and full fine-tuning, 2 runs each
    python bench/profile_compile.py --variant lora --runs 3 --layers 8 --hidden 128

For each variant it starts a fresh Python process ``--runs`` times with the same (initially
empty) cache directory -- torch's inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and this
project's compile cache (``GRPO_PLUGINS_COMPILE_CACHE``) -- so the first run is cold and the
later ones see what an earlier run on the same machine left behind. Each run builds an Engine
on a small random Llama (``grpo_plugins.testing.tiny``), with ``compile_layers`` on and the
``static`` generator's decode step compiled, all with the inductor backend (on a CPU too, where
inductor generates C++; the project itself uses ``aot_eager`` there), trains ``--steps`` steps
and reports:

* ``compile/seconds`` (``compile_stats()``, what the step log shows) and the wall time;
* torch's per-phase timers (``torch._dynamo.utils.compilation_time_metrics``): dynamo's
  tracing (``_compile.compile_inner`` minus the backend), the backend on the forward graph
  (AOTAutograd and inductor, cache lookups included), inductor's code generation (forward and
  backward), backward compilation, and the frame compiles (a restarted trace or a
  recompilation counts again);
* the cache counters: inductor's FX graph cache and AOTAutograd's cache hits, misses and
  bypasses, graphs compiled, recompilations, graph breaks;
* the time to load the project's compile cache (``*``: a file was loaded).

``--fresh-inductor`` gives every run an empty inductor cache, so that only the project's compile
cache carries over (a machine whose ``/tmp`` was wiped).

Writes ``$OUT/profile_compile.json`` (``OUT`` defaults to ``outputs/bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


# -- one run (child process) ----------------------------------------------------------------------


def _force_inductor() -> None:
    """Compile with inductor on any device: the training passes' layers and the static decode
    step (which the project compiles only on CUDA)."""
    from grpo_plugins import compiled_layers, run_parts
    from grpo_plugins.generators import static_cache

    def layers_for(model: Any, compile_layers: Any, device: Any, *, quantized: bool = False) -> Any:
        return compiled_layers.CompiledLayers.for_model(model, backend="inductor")

    run_parts.compiled_layers_for = layers_for  # type: ignore[assignment]
    original = static_cache.decode_flags

    def decode_flags(params: Any, on_cuda: bool, quantized: bool) -> tuple[bool, bool]:
        return params.compile, original(params, on_cuda, quantized)[1]

    static_cache.decode_flags = decode_flags  # type: ignore[assignment]


def _time_cache_load() -> dict[str, Any]:
    """Time the project's compile cache load (where this checkout has one)."""
    result: dict[str, Any] = {"seconds": 0.0, "loaded": False}
    try:
        from grpo_plugins.compile_cache import CompileCache
    except ImportError:
        return result
    original = CompileCache.load

    def load(self: Any) -> bool:
        t0 = time.perf_counter()
        result["loaded"] = original(self)
        result["seconds"] += time.perf_counter() - t0
        return result["loaded"]

    CompileCache.load = load  # type: ignore[method-assign]
    return result


def _phases() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    sums = {key: float(sum(times)) for key, times in compilation_time_metrics.items()}  # in call order

    def total(*needles: str) -> float:
        return sum(v for k, v in sums.items() if any(n in k for n in needles))

    compile_inner = sums.get("_compile.compile_inner", 0.0)
    backend = sums.get("OutputGraph.call_user_compiler", 0.0)
    return {
        "dynamo_total": compile_inner,
        "dynamo_tracing": compile_inner - backend,  # bytecode analysis, guards, FX graph
        "backend_forward": backend,  # AOTAutograd + inductor for the forward (and joint) graph
        "aot_dispatch": total("create_aot_dispatcher_function"),
        "inductor_codegen": sums.get("fx_codegen_and_compile", 0.0),  # forward and backward graphs
        "frame_compiles": float(len(compilation_time_metrics.get("_compile.compile_inner", []))),
        "each_frame_compile": [round(float(t), 3) for t in compilation_time_metrics.get("_compile.compile_inner", [])],
        "backward_compile": total("bw_compiler"),
        "cache_load": total("load_cache_artifacts", "compile_cache_load"),
        "raw": sums,
    }


def _counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "frames_calls": counters["stats"]["calls_captured"],
        "recompiles": sum(counters["recompiles"].values()),  # what this torch counts as one
        "recompile_reasons": dict(counters["recompiles"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": dict(counters["graph_break"]),
        "fxgraph_hit": inductor["fxgraph_cache_hit"],
        "fxgraph_miss": inductor["fxgraph_cache_miss"],
        "fxgraph_bypass": inductor["fxgraph_cache_bypass"],
        "aot_hit": aot["autograd_cache_hit"],
        "aot_miss": aot["autograd_cache_miss"],
        "aot_bypass": aot["autograd_cache_bypass"],
        "aot_bypass_reasons": {k: v for k, v in aot.items() if "bypass" in k and k != "autograd_cache_bypass"},
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch

    from grpo_plugins.compiled_layers import compile_stats
    from grpo_plugins.engine import Engine
    from grpo_plugins.metrics import read_metrics
    from grpo_plugins.models import load_model
    from grpo_plugins.testing import tiny_model_spec

    t_import = time.perf_counter() - t_start
    _force_inductor()
    cache_load = _time_cache_load()
    work = Path(tempfile.mkdtemp(prefix="profile_compile_"))
    overrides = dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_attention_heads=4, num_key_value_heads=2,
    )
    spec = tiny_model_spec(work / "model", "llama", **overrides)
    lora = {"r": 8, "target_modules": "all-linear"} if args.variant == "lora" else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model, tok = load_model(spec, dtype=dtype, seed=0, gradient_checkpointing=True, lora=lora)
    model.to(device)
    out = work / "out"
    cfg: dict[str, Any] = {
        "model": spec,
        "task": None,
        "output_dir": str(out),
        "max_steps": args.steps,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,  # off-policy second step: the old-logp pass runs too
        "num_generations": 4,
        "max_completion_length": args.tokens,
        "learning_rate": 1e-3,
        "report_to": ["jsonl"],
        "seed": 0,
        "beta": 0.1 if args.variant == "lora" else 0.0,  # LoRA: the reference pass (adapters off) too
        "gradient_checkpointing": True,
        "compile_layers": True,
        "generator": {"name": args.generator} if args.generator else None,
    }
    if args.generator is None:
        cfg.pop("generator")
    engine = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    t0 = time.perf_counter()
    engine.train()
    train_s = time.perf_counter() - t0
    rows = read_metrics(out)
    return {
        "variant": args.variant,
        "device": device,
        "torch": torch.__version__,
        "import_s": t_import,
        "cache_load_s": cache_load["seconds"],
        "cache_loaded": cache_load["loaded"],
        "train_s": train_s,
        "total_s": time.perf_counter() - t_start,
        **compile_stats(),
        "phases": _phases(),
        "counters": _counters(),
        "losses": [r.get("loss") for r in rows],
    }


# -- the driver -------------------------------------------------------------------------------------


def _row(label: str, r: dict[str, Any]) -> str:
    p, c = r["phases"], r["counters"]
    return (
        f"{label:<10} compile {r['compile/seconds']:6.1f}s  wall {r['total_s']:6.1f}s  "
        f"cache load {r.get('cache_load_s', 0.0):4.1f}s{'*' if r.get('cache_loaded') else ' '} | "
        f"tracing {p['dynamo_tracing']:5.1f}  aot+ind fw {p['backend_forward']:5.1f}  bw {p['backward_compile']:5.1f}  "
        f"codegen {p['inductor_codegen']:5.1f} | graphs {c['graphs']:3d} frame compiles {p['frame_compiles']:3.0f} "
        f"breaks {c['graph_breaks']:2d} | fx hit/miss/bypass {c['fxgraph_hit']}/{c['fxgraph_miss']}/{c['fxgraph_bypass']}  "
        f"aot hit/miss/bypass {c['aot_hit']}/{c['aot_miss']}/{c['aot_bypass']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["lora", "full", "both"], default="both")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes per variant, same cache dir")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8, help="max_completion_length")
    parser.add_argument("--generator", default="static", help="generator name ('' for the default)")
    parser.add_argument("--cache-dir", default=None, help="reuse this cache dir (default: a new empty one per variant)")
    parser.add_argument(
        "--fresh-inductor", action="store_true",
        help="give every run an empty inductor cache (a machine whose /tmp was wiped): only the project's compile cache carries over",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.generator = args.generator or None
    if args.child:
        result = child(args)
        Path(args.result).write_text(json.dumps(result))
        return

    variants = ["lora", "full"] if args.variant == "both" else [args.variant]
    results: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        cache = Path(args.cache_dir) / variant if args.cache_dir else Path(tempfile.mkdtemp(prefix=f"compile_cache_{variant}_"))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "GRPO_PLUGINS_COMPILE_CACHE": str(cache / "grpo"),
        }
        results[variant] = []
        for run in range(args.runs):
            result_file = cache / f"result_{run}.json"
            cache.mkdir(parents=True, exist_ok=True)
            if args.fresh_inductor:
                env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_", dir=cache)
            cmd = [
                sys.executable, __file__, "--child", "--result", str(result_file), "--variant", variant,
                "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
                "--tokens", str(args.tokens), "--generator", args.generator or "",
            ]
            subprocess.run(cmd, env=env, check=True)
            r = json.loads(result_file.read_text())
            results[variant].append(r)
            print(_row(f"{variant} #{run + 1}", r), flush=True)
        losses = {json.dumps(r["losses"]) for r in results[variant]}
        print(f"{variant}: losses {'identical' if len(losses) == 1 else 'DIFFER'} across runs: {results[variant][0]['losses']}")
    out = Path(os.environ.get("OUT", "outputs/bench"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_compile.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'profile_compile.json'}")


if __name__ == "__main__":
    main()
