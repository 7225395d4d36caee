"""Times the float8 decode kernel (``grpo_plugins.generators.fp8_products``) against cuBLAS bf16
(``F.linear``) and cuBLASLt float8 (``torch._scaled_mm``) on the fused projections of a decode
step, and sweeps the kernel's launch settings per projection; the same for its weight-only form
(16-bit input, each float8 weight tile widened in the kernel).

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


def _sweep(product: Any, weights: list[Any], weight_bytes: int) -> list[dict[str, Any]]:
    """The five fastest of :func:`_sweep_configs` for ``product(config, weight)``, timed over
    ``weights``; configurations that do not launch (e.g. out of shared memory) are skipped."""
    timed = []
    for config in _sweep_configs():
        try:
            us = graph_time_us([lambda q=q: product(config, q) for q in weights], repeats=10)
        except Exception as exc:  # noqa: BLE001 - skip the config
            print(f"    {config}: {type(exc).__name__}", flush=True)
            continue
        timed.append((us, config))
    timed.sort(key=lambda t: t[0])
    return [{"us": us, "TBps": weight_bytes / us / 1e6, **c} for us, c in timed[:5]]


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
            # The weight-only kernel: the 16-bit input as it is (no row quantisation before it).
            w8a16 = graph_time_us([lambda q=q: run_kernel(x, None, q[0], q[1], torch.bfloat16, reduce=False) for q in w8s])
            bits = {"widen_bits": True}  # the weight tile widened through float16's bits
            w8a16_bits = graph_time_us([lambda q=q: run_kernel(x, None, q[0], q[1], torch.bfloat16, bits, reduce=False) for q in w8s])
            err16_bits = float((run_kernel(x, None, w8s[0][0], w8s[0][1], torch.float32, bits) - run_kernel(x, None, w8s[0][0], w8s[0][1], torch.float32)).abs().max())
            got16 = run_kernel(x, None, w8s[0][0], w8s[0][1], torch.float32)
            want16 = x.float() @ (w8s[0][0].float() * w8s[0][1].reshape(-1, 1)).t()
            err16 = float((got16 - want16).abs().max() / want16.abs().max())
            row: dict[str, Any] = {
                "model": model, "product": name, "N": N, "K": K, "plan": plan(args.rows, N, K, sms), "rel_err": err,
                "bf16_us": bf16, "scaled_mm_us": lt, "kernel_us": ours,
                "weight_only_us": w8a16, "weight_only_rel_err": err16, "weight_only_bits_us": w8a16_bits,
                "weight_only_bits_max_diff": err16_bits,
                "weight_only_plan": plan(args.rows, N, K, sms, 2),
                "bf16_TBps": 2 * N * K / bf16 / 1e6, "scaled_mm_TBps": N * K / lt / 1e6, "kernel_TBps": N * K / ours / 1e6,
            }
            print(
                f"{model:13} {name:8} {N:6}x{K:<6} bf16 {bf16:6.1f} us ({row['bf16_TBps']:.2f} TB/s)  "
                f"_scaled_mm {lt:6.1f} ({row['scaled_mm_TBps']:.2f})  kernel {ours:6.1f} ({row['kernel_TBps']:.2f}) "
                f"{row['plan']}  rel err {err:.1e}\n{'':22} weight-only {w8a16:6.1f} ({N * K / w8a16 / 1e6:.2f}) "
                f"{row['weight_only_plan']} rel err {err16:.1e}; widened through bits {w8a16_bits:6.1f} (diff {err16_bits:.1e})",
                flush=True,
            )
            if not args.no_sweep:
                for key, label, x_in, x_scale in (("best", "", x8, xs), ("weight_only_best", "weight-only ", x, None)):
                    row[key] = _sweep(lambda config, q, x_in=x_in, x_scale=x_scale: run_kernel(x_in, x_scale, q[0], q[1], torch.bfloat16, config, reduce=False), w8s, N * K)
                    for best in row[key][:3]:
                        print(f"{'':22} {label}{best['us']:6.1f} us ({best['TBps']:.2f} TB/s) {dict(list(best.items())[2:])}", flush=True)
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
