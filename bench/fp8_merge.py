"""Times the float8-base decode-copy merge (``grpo_plugins.fp8_rounding``: base + LoRA update,
rounded stochastically back onto float8) as one Triton kernel against the same function as
torch operations, on the frozen projections of a model shape, and checks that the two agree.

``python bench/fp8_merge.py [--shape qwen2.5-7b] [--repeats 5]``

Per projection: milliseconds for the kernel and for the torch operations, the share of float8
values whose bits differ between them (the GPU's float32 division may move a rare value to the
neighbouring grid point) and the largest distance in grid steps; then the total over all layers
of the shape, which the ``static`` generator spends before each generation on a float8 base.
Without a CUDA GPU (or with ``--shape tiny``) it runs a small case through the torch operations
only. With ``OUT`` set, writes ``fp8_merge.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from grpo_plugins.fp8_base import quantize_rows
from grpo_plugins.fp8_rounding import merge_agreement, merge_rows_reference, run_kernel, triton

#: (name, N, K, per layer) of the frozen projections a float8 base holds, one Float8Linear each.
SHAPES = {
    "qwen2.5-7b": (28, [("q", 3584, 3584, 1), ("k/v", 512, 3584, 2), ("o", 3584, 3584, 1), ("gate/up", 18944, 3584, 2), ("down", 3584, 18944, 1)]),
    "qwen2.5-1.5b": (28, [("q", 1536, 1536, 1), ("k/v", 256, 1536, 2), ("o", 1536, 1536, 1), ("gate/up", 8960, 1536, 2), ("down", 1536, 8960, 1)]),
    "tiny": (2, [("q", 64, 96, 1), ("down", 48, 160, 1)]),
}


def _time_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up (and the kernel's compilation)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


def measure(shape: str, repeats: int, device: torch.device, use_kernel: bool) -> dict[str, Any]:
    """Each projection of ``shape`` merged by the torch operations (and the kernel)."""
    layers, projections = SHAPES[shape]
    rows = []
    for name, n, k, count in projections:
        torch.manual_seed(0)
        weight8, scale = quantize_rows(torch.randn(n, k, device=device) * 0.02)
        delta = torch.randn(n, k, device=device) * 0.05 * scale  # a trained adapter's update, float32 as the generator passes it
        row: dict[str, Any] = {"projection": name, "N": n, "K": k, "per_layer": count}
        row["torch_ms"] = _time_ms(lambda: merge_rows_reference(weight8, scale[:, 0], delta, seed=1), repeats, device)
        if use_kernel:
            row["kernel_ms"] = _time_ms(lambda: run_kernel(weight8, scale[:, 0], delta, seed=1), repeats, device)
            row.update(merge_agreement(run_kernel(weight8, scale[:, 0], delta, 1), merge_rows_reference(weight8, scale[:, 0], delta, 1)))
        rows.append(row)
    totals = {key: layers * sum(r[key] * r["per_layer"] for r in rows) for key in ("torch_ms", "kernel_ms") if key in rows[0]}
    return {"shape": shape, "layers": layers, "device": str(device), "projections": rows, "per_model_ms": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.shape if cuda else "tiny"
    result = measure(shape, args.repeats, device, use_kernel=cuda and triton is not None)
    for row in result["projections"]:
        kernel = f"kernel {row['kernel_ms']:.3f} ms, bits differ {row['bits_differ']:.2e}, largest {row['largest_grid_steps']:.2f} steps" if "kernel_ms" in row else "kernel -"
        print(f"{row['projection']:<8} {row['N']:>6} x {row['K']:<6} torch {row['torch_ms']:.3f} ms   {kernel}")
    print(f"{result['shape']} ({result['layers']} layers), per generation: " + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in result["per_model_ms"].items()))
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "fp8_merge.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
