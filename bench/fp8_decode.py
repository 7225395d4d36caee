"""Times the float8 decode kernel (``grpo_plugins.generators.fp8_products``) against cuBLAS bf16
(``F.linear``) and cuBLASLt float8 (``torch._scaled_mm``) on the fused projections of a decode
step, and sweeps the kernel's launch settings per projection.

``python bench/fp8_decode.py [--rows 64] [--no-sweep]``

The kernel is timed without adding its partial sums over K (when it splits K): in the decode
step that sum runs inside the compiled kernel that consumes the product. Each product is timed over enough copies of its weight (>= 256 MB in all) that the weights come
from memory, not from L2, replayed in a CUDA graph as the decode step is. Prints each product's
time and weight bandwidth; with ``OUT`` set, writes ``fp8_decode.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import graph_time_us  # noqa: E402

from grpo_plugins.generators.fp8_products import plan, run_kernel  # noqa: E402
from grpo_plugins.generators.static_layers import quantize_rows  # noqa: E402

#: (name, N, K) of the fused decode projections: q/k/v, o, gate/up, down.
SHAPES = {
    "qwen2.5-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "qwen2.5-1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)],
}


def _sweep_configs() -> list[dict[str, int]]:
    configs = []
    for block_n in (64, 128):
        for block_k in (128, 256):
            for split in (1, 2, 4, 8):
                for num_stages in (3, 4, 6):
                    for num_warps in (4, 8) if block_n == 128 else (4,):
                        configs.append({"block_n": block_n, "block_k": block_k, "split": split, "num_warps": num_warps, "num_stages": num_stages})
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--no-sweep", action="store_true", help="time the planned launch only")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for model, shapes in SHAPES.items():
        for name, N, K in shapes:
            copies = max(2, -(-256 * 2**20 // (N * K)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            w8s = [quantize_rows(w) for w in ws]
            x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16)
            x8, xs = quantize_rows(x)
            want = torch._scaled_mm(x8, w8s[0][0].t(), scale_a=xs, scale_b=w8s[0][1].reshape(1, -1), out_dtype=torch.float32)
            got = run_kernel(x8, xs, w8s[0][0], w8s[0][1], torch.float32)
            err = float((got - want).abs().max() / want.abs().max())
            bf16 = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            lt = graph_time_us([lambda q=q: torch._scaled_mm(x8, q[0].t(), scale_a=xs, scale_b=q[1].reshape(1, -1), out_dtype=torch.bfloat16) for q in w8s])
            ours = graph_time_us([lambda q=q: run_kernel(x8, xs, q[0], q[1], torch.bfloat16, reduce=False) for q in w8s])
            row: dict[str, Any] = {
                "model": model, "product": name, "N": N, "K": K, "plan": plan(args.rows, N, K, sms), "rel_err": err,
                "bf16_us": bf16, "scaled_mm_us": lt, "kernel_us": ours,
                "bf16_TBps": 2 * N * K / bf16 / 1e6, "scaled_mm_TBps": N * K / lt / 1e6, "kernel_TBps": N * K / ours / 1e6,
            }
            print(
                f"{model:13} {name:8} {N:6}x{K:<6} bf16 {bf16:6.1f} us ({row['bf16_TBps']:.2f} TB/s)  "
                f"_scaled_mm {lt:6.1f} ({row['scaled_mm_TBps']:.2f})  kernel {ours:6.1f} ({row['kernel_TBps']:.2f}) "
                f"{row['plan']}  rel err {err:.1e}",
                flush=True,
            )
            if not args.no_sweep:
                timed = []
                for config in _sweep_configs():
                    try:
                        us = graph_time_us([lambda q=q: run_kernel(x8, xs, q[0], q[1], torch.bfloat16, config, reduce=False) for q in w8s], repeats=10)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                        print(f"    {config}: {type(exc).__name__}", flush=True)
                        continue
                    timed.append((us, config))
                timed.sort(key=lambda t: t[0])
                row["best"] = [{"us": us, "TBps": N * K / us / 1e6, **c} for us, c in timed[:5]]
                for best in row["best"][:3]:
                    print(f"{'':22} {best['us']:6.1f} us ({best['TBps']:.2f} TB/s) {dict(list(best.items())[2:])}", flush=True)
            results.append(row)
            del ws, w8s
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fp8_decode.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": args.rows, "products": results}, f, indent=1)


if __name__ == "__main__":
    main()
