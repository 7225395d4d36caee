"""Run an example config exactly as a user does (``grpo-plugins train CONFIG --set ...``) and
summarise its ``metrics.jsonl``: step times, reward per window of steps, compile cost and
recompilations, non-finite steps, peak memory.

    python bench/run_example.py examples/arithmetic_smollm2_lora_gpu.yaml --set max_steps=120 \
        --name lora-defaults

Writes ``$OUT/example-<name>.json`` and prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import out_dir, write_json  # noqa: E402


def window_means(history: list[dict[str, Any]], key: str, size: int) -> list[tuple[int, int, float]]:
    """(first step, last step, mean of ``key``) for consecutive windows of ``size`` steps."""
    out = []
    for start in range(0, len(history), size):
        chunk = [h[key] for h in history[start : start + size] if key in h]
        if chunk:
            out.append((start + 1, start + len(chunk), sum(chunk) / len(chunk)))
    return out


def summarise(history: list[dict[str, Any]], window: int) -> dict[str, Any]:
    steps = [h.get("timing/step", float("nan")) for h in history]
    reward_keys = sorted({k for h in history for k in h if k.startswith("rewards/") and k.endswith("/mean")})
    graphs = [h.get("compile/graphs", 0.0) for h in history]
    phases = {p: [h[f"timing/{p}"] for h in history if f"timing/{p}" in h] for p in ("generate", "train")}
    return {
        "steps": len(history),
        "step_s_median": statistics.median(steps) if steps else None,
        **{f"{p}_s_median": statistics.median(v) if v else None for p, v in phases.items()},
        "step_s_median_after_5": statistics.median(steps[5:]) if len(steps) > 5 else None,
        "first_steps_s": steps[:5],
        "compile_seconds": history[-1].get("compile/seconds") if history else None,
        "compile_graphs": graphs[-1] if graphs else None,
        "graphs_compiled_after_step_2": (graphs[-1] - graphs[1]) if len(graphs) > 2 else None,
        "steps_with_new_graphs": [i + 1 for i in range(1, len(graphs)) if graphs[i] > graphs[i - 1]],
        "nonfinite_skipped": sum(h.get("nonfinite_skipped", 0.0) for h in history),
        "peak_memory_gb": max((h.get("peak_memory_gb", 0.0) for h in history), default=None),
        "reward_windows": window_means(history, "reward", window),
        **{f"{k}_windows": window_means(history, k, window) for k in reward_keys},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], help="key=value, as for grpo-plugins train")
    parser.add_argument("--name", default="example")
    parser.add_argument("--window", type=int, default=30, help="steps per reward window")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="stop the run after this many seconds and summarise the steps it logged (do not kill this script from outside: it writes its JSON at the end)",
    )
    args = parser.parse_args()

    output_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"example-{args.name}"
    shutil.rmtree(output_dir, ignore_errors=True)  # a scratch folder: a fresh run, not one mixed with the last
    command = [sys.executable, "-m", "grpo_plugins.cli", "train", args.config, "--set", f"output_dir={output_dir}"]
    for item in args.set:
        command += ["--set", item]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = "timeout"
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.perf_counter() - start
    history = []
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file():
        history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = {
        "command": command,
        "returncode": returncode,
        "wall_s": wall,
        "stderr_tail": stderr[-3000:],
        "stdout_tail": stdout[-1500:],
        **summarise(history, args.window),
        "history": history,
    }
    write_json(out_dir() / f"example-{args.name}.json", summary)
    short = {k: v for k, v in summary.items() if k not in ("history", "stdout_tail", "command")}
    if returncode == 0:
        short.pop("stderr_tail")
    print(json.dumps(short, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
