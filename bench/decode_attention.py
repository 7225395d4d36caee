"""Times the decode attention kernel (``grpo_plugins.generators.decode_attention``) alone: one
layer's RoPE, cache write and window attention for one new token per row, over windows of
growing length, with the window in one program per (row, key/value head) and split over
several (the default rule, ``window_splits``, and others), against the torch operations.

``python bench/decode_attention.py [--windows 128 512 1088 4096 8192] [--splits 1 2 4 8 16]
[--launch 64,4,3 128,8,3]``

``--launch`` times the kernel (parts by the default rule) with other keys per block, warps and
pipeline stages (``BLOCK,WARPS,STAGES``); ``--early`` with its cache loads not waiting for the
new token's index.

Each case is replayed in a CUDA graph over enough layers' caches (>= 256 MB in all) that the
keys and values come from memory, not from L2. Prints microseconds per layer and the bandwidth
of the window's keys and values; with ``OUT`` set, writes ``decode_attention.json`` there.
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

from grpo_plugins.generators.decode_attention import multiprocessors, rope_window_attention, run_rope_kernel, window_splits  # noqa: E402

#: (name, rows, query heads, key/value heads, head dim) of the benchmark shapes' decode batches.
SHAPES = [("qwen2.5-0.5b", 64, 14, 2, 64), ("qwen2.5-1.5b", 64, 12, 2, 128), ("qwen2.5-7b", 64, 28, 4, 128), ("qwen2.5-7b", 16, 28, 4, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512, 1088, 4096, 8192])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="fixed splits timed besides the default rule")
    parser.add_argument("--launch", nargs="*", default=[], help="BLOCK,WARPS,STAGES launch settings timed besides the default")
    parser.add_argument("--shapes", nargs="*", default=None, help="only these shape names")
    parser.add_argument("--early", action="store_true", help="also time the kernel with its cache loads not waiting for the index")
    args = parser.parse_args()
    launches = [tuple(int(x) for x in spec.split(",")) for spec in args.launch]
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    results = []
    for name, B, Hq, Hkv, D in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        for W in args.windows:
            kv_bytes = 2 * B * Hkv * W * D * 2
            layers = max(2, -(-256 * 2**20 // kv_bytes))
            caches = [(torch.randn(B, Hkv, W, D, device=dev, dtype=dt), torch.randn(B, Hkv, W, D, device=dev, dtype=dt)) for _ in range(layers)]
            q, k, v = (torch.randn(B, h, D, device=dev, dtype=dt) for h in (Hq, Hkv, Hkv))
            angles = torch.rand(B, D // 2, device=dev) * 6.3
            cos, sin = torch.cat([angles.cos()] * 2, -1).to(dt), torch.cat([angles.sin()] * 2, -1).to(dt)
            index = torch.tensor([W - 1], device=dev)
            bias = torch.zeros(B, W, device=dev)
            scale = D**-0.5
            row: dict[str, Any] = {"shape": name, "rows": B, "window": W, "default_splits": window_splits(W, B * Hkv * D, multiprocessors(torch.device(dev))), "kv_MB": kv_bytes / 1e6}
            row["torch_us"] = graph_time_us([lambda c=c: rope_window_attention(q, k, v, cos, sin, c[0], c[1], index, bias, scale) for c in caches])
            row["default_us"] = graph_time_us([lambda c=c: run_rope_kernel(q, k, v, cos, sin, c[0], c[1], index, bias, scale) for c in caches])
            for splits in args.splits:
                row[f"splits{splits}_us"] = graph_time_us(
                    [lambda c=c, s=splits: run_rope_kernel(q, k, v, cos, sin, c[0], c[1], index, bias, scale, splits=s) for c in caches]
                )
            if args.early:
                row["early_us"] = graph_time_us([lambda c=c: run_rope_kernel(q, k, v, cos, sin, c[0], c[1], index, bias, scale, early=True) for c in caches])
            for block, warps, stages in launches:
                row[f"launch{block},{warps},{stages}_us"] = graph_time_us(
                    [lambda c=c, b=block, w=warps, s=stages: run_rope_kernel(q, k, v, cos, sin, c[0], c[1], index, bias, scale, block=b, warps=w, stages=s) for c in caches]
                )
            fixed = "  ".join(f"{s}:{row[f'splits{s}_us']:.1f}" for s in args.splits)
            fixed += "".join(f"  [{b},{w},{s}]:{row[f'launch{b},{w},{s}_us']:.1f}" for b, w, s in launches)
            fixed += f"  early:{row['early_us']:.1f}" if args.early else ""
            print(
                f"{name:13} {B:3} rows  W {W:5}  torch {row['torch_us']:7.1f} us  default ({row['default_splits']} parts) "
                f"{row['default_us']:6.1f} us ({kv_bytes / row['default_us'] / 1e6:.2f} TB/s)  fixed parts {fixed}",
                flush=True,
            )
            results.append(row)
            del caches
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "decode_attention.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
