"""GPU check of the non-finite LoRA gradient once seen under compiled layers: cuDNN attention's backward with left padding.

One attention call shaped like a SmolLM2-135M layer (9 query heads, 3 key/value heads, head
dim 64, bf16) over a left-padded batch (some query rows attend to nothing), the loss on the
real rows only. For each sequence length and each choice of SDPA backends it reports whether
the q/k/v gradients are finite:

* ``default``: torch's own choice (cuDNN on an H100/H200 with torch 2.11 when a mask is given);
* ``cudnn``, ``efficient``, ``math``: one backend forced;
* ``training``: ``grpo_plugins.attention.training_attention()``, what the training passes use.

    python bench/check_sdpa_nan.py --out $OUT/sdpa_nan.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def trial(length: int, context: contextlib.AbstractContextManager, seed: int = 0) -> dict:
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator(device="cuda").manual_seed(seed)
    B, Hq, Hkv, D = 8, 9, 3, 64
    q = torch.randn(B, Hq, length, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, length, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, length, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    pads = torch.arange(B, device="cuda") * 3  # row b has 3*b left-padding columns
    real = torch.arange(length, device="cuda")[None, :] >= pads[:, None]  # (B, L)
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    mask = (causal[None] & real[:, None, :])[:, None]  # (B, 1, L, L) keys each query may see
    with context:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, Hq // Hkv), repeat_kv(v, Hq // Hkv), attn_mask=mask
        )
    (out.float() * real[:, None, :, None]).sum().backward()  # the loss sees real rows only
    return {
        "out_finite": bool(torch.isfinite(out[real[:, None, :, None].expand_as(out)]).all()),
        **{f"d{n}_finite": bool(torch.isfinite(t.grad).all()) for n, t in (("q", q), ("k", k), ("v", v))},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[190, 191, 192, 200, 256, 320, 448])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench._common import out_dir, write_json
    from grpo_plugins.attention import training_attention

    variants = {
        "default": contextlib.nullcontext,
        "cudnn": lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]),
        "efficient": lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]),
        "math": lambda: sdpa_kernel([SDPBackend.MATH]),
        "training": training_attention,
    }
    results: dict = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                     "device": torch.cuda.get_device_name(), "trials": {}}
    for length in args.lengths:
        for name, make in variants.items():
            try:
                r = trial(length, make())
            except RuntimeError as exc:  # a forced backend that refuses these inputs
                r = {"error": str(exc).splitlines()[0][:200]}
            results["trials"][f"{length}/{name}"] = r
            ok = "error" if "error" in r else ("finite" if all(r.values()) else "NON-FINITE " + str(r))
            print(f"L={length:4d} {name:10s} {ok}", flush=True)
    write_json(Path(args.out) if args.out else out_dir() / "sdpa_nan.json", results)
    print(json.dumps({k: v for k, v in results.items() if k != "trials"}))


if __name__ == "__main__":
    main()
