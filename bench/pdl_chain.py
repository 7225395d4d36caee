"""Can programmatic dependent launch hide the decode products' fixed cost?

At 64 rows a decode step's products stream their weights at ~3 TB/s, but each also costs ~4 us
that does not scale with its size (launch, ramp-up, the first loads' latency, the tail): at 1.5B
that is ~40 % of a step (bench/RESULTS.md, "Where the decode step's time goes"). With CUDA's
programmatic dependent launch a kernel starts while the one before it runs, loads what does not
depend on it (its first block of weights) and waits (``griddepcontrol.wait``) only before
reading its input. This times a decoder's chain of products (q/k/v -> o -> gate/up -> down, each
reading the one before's output, distinct weights per layer so they come from memory) in one
CUDA graph:

* ``cublas``: ``torch.mm`` (what the decode step runs now);
* ``triton``: a product kernel for 64 rows, one program per block of output columns (the 64
  rows as the left operand);
* ``swapped``: the float8 decode kernel's form in 16 bits: a tile of 64 weight rows as the left
  operand times all 64 input rows, K split over programs until every multiprocessor has one,
  the float32 parts added by a second kernel;
* ``-pdl``: the same kernels launched with programmatic dependent launch, each product's first
  block of weights loaded before the wait.

``python bench/pdl_chain.py [--shape qwen2.5-1.5b] [--layers 28] [--configs 32,128,4] [--swapped 64,128,4]``

``--configs`` / ``--swapped``: BLOCK_N,BLOCK_K,STAGES of the kernels (``--configs`` uses BLOCK_N 64 for gate/up). Prints
microseconds per layer, the weights' bandwidth, and the largest difference from ``cublas``;
with ``OUT`` set writes ``pdl_chain.json`` there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import graph_time_us, write_json  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch: the -pdl variants fail
    gdc_launch_dependents = gdc_wait = None

#: hidden size, q/k/v width, intermediate size of each benchmark shape
SHAPES = {"qwen2.5-0.5b": (896, 1152, 4864), "qwen2.5-1.5b": (1536, 2048, 8960), "qwen2.5-7b": (3584, 4608, 18944)}
ROWS = 64

if triton is not None:

    @triton.jit
    def _rows_product_kernel(
        x_ptr, w_ptr, y_ptr, K, stride_x, stride_w, stride_y,
        M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):
        """y (M, N) = x (M, K) @ w (N, K).T for one block of BLOCK_N output columns."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm = tl.arange(0, M)
        w_tile = w_ptr + rn[None, :] * stride_w + rk[:, None]  # (BLOCK_K, BLOCK_N): w transposed
        x_tile = x_ptr + rm[:, None] * stride_x + rk[None, :]
        w = tl.load(w_tile)  # the first block of weights does not depend on the kernel before
        if PDL:
            gdc_launch_dependents()
            gdc_wait()  # the input is the kernel before's output
        acc = tl.dot(tl.load(x_tile), w)
        for k in range(BLOCK_K, K, BLOCK_K):
            acc += tl.dot(tl.load(x_tile + k), tl.load(w_tile + k))
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty))


if triton is not None:

    @triton.jit
    def _swapped_kernel(
        w_ptr, x_ptr, out_ptr, bias_ptr, K, k_per_split, N, stride_w, stride_x, stride_out,
        M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
        BIAS: tl.constexpr,
    ):
        """out = x (M, K) @ w (N, K).T with the operands swapped, as the float8 decode kernel does:
        a tile of BLOCK_N weight rows times all M input rows, over this program's part of K.
        SPLIT > 1: float32 partial sums (SPLIT, M, N) for :func:`_sum_parts_kernel`."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(1) * k_per_split
        rk = tl.arange(0, BLOCK_K)
        rm = tl.arange(0, M)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + k_start
        x_rows = x_ptr + rm[:, None] * stride_x + k_start
        w = tl.load(w_rows + rk[None, :])  # independent of the kernel before: loaded before the wait
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        acc = tl.dot(w, tl.trans(tl.load(x_rows + rk[None, :])))  # (BLOCK_N, M) float32
        for k in range(BLOCK_K, k_per_split, BLOCK_K):
            acc = tl.dot(tl.load(w_rows + (k + rk)[None, :]), tl.trans(tl.load(x_rows + (k + rk)[None, :])), acc)
        if SPLIT == 1:
            if BIAS:
                acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
            tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], acc.to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + tl.program_id(1) * M * N + rm[None, :] * N + rn[:, None], acc)

    @triton.jit
    def _sum_parts_kernel(part_ptr, out_ptr, bias_ptr, N, stride_out, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, BIAS: tl.constexpr):
        """out[m, :] = the SPLIT partial sums of row m added in a fixed order (then the bias), rounded once."""
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = rn < N
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        total = tl.zeros((BLOCK,), tl.float32)
        for s in range(SPLIT):
            total += tl.load(part_ptr + (s * tl.num_programs(0) + m) * N + rn, mask=inside, other=0.0)
        if BIAS:
            total += tl.load(bias_ptr + rn, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_out + rn, total.to(out_ptr.dtype.element_ty), mask=inside)


def swapped_split(N: int, K: int, block_n: int, block_k: int, sms: int = 132) -> int:
    """K parts for an (N, K) weight: the fewest that give every multiprocessor a program (at most
    16), each part a whole number of K blocks."""
    tiles, blocks = N // block_n, K // block_k
    wanted = -(-sms // tiles)
    fits = [s for s in range(1, 17) if blocks % s == 0]
    return next((s for s in fits if s >= wanted), fits[-1])


def swapped_product(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, parts: torch.Tensor, block_n: int, block_k: int, stages: int, pdl: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out`` = x @ w.T (+ ``bias``) by :func:`_swapped_kernel`, K split by
    :func:`swapped_split` and the parts added by :func:`_sum_parts_kernel` (``parts``: float32
    scratch of >= 16 x M x N). M (x's rows) a power of two from 16 to 128."""
    N, K = w.shape
    M = x.shape[0]
    assert x.shape[1] == K and M in (16, 32, 64, 128) and N % block_n == 0 and K % block_k == 0, (x.shape, w.shape, block_n, block_k)
    split = swapped_split(N, K, block_n, block_k)
    extra = {"launch_pdl": True} if pdl else {}
    b = w if bias is None else bias  # not read without a bias
    _swapped_kernel[(N // block_n, split)](
        w, x, out if split == 1 else parts, b, K, K // split, N, w.stride(0), x.stride(0), out.stride(0),
        M=M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, PDL=pdl, BIAS=bias is not None, num_warps=4, num_stages=stages, **extra,
    )
    if split > 1:
        _sum_parts_kernel[(M, triton.cdiv(N, 1024))](
            parts, out, b, N, out.stride(0), SPLIT=split, BLOCK=1024, PDL=pdl, BIAS=bias is not None, num_warps=4, **extra
        )
    return out


# -- the decode step with these products (bench/profile_decode.py's ``swapped`` and ``pdl`` variants)


@torch.library.custom_op("grpo_bench::swapped_mm", mutates_args=())
def swapped_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    """x (M, K) @ w (N, K).T + bias by :func:`swapped_product` on a GPU (64 x 128 tiles, 4
    stages); ``F.linear`` elsewhere."""
    if x.device.type != "cuda":
        return torch.nn.functional.linear(x, w, bias)
    N = w.shape[0]
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    parts = torch.empty(16 * x.shape[0] * N, dtype=torch.float32, device=x.device)
    return swapped_product(x, w, out, parts, 64, 128, 4, pdl, bias)


@swapped_mm.register_fake
def _(x, w, bias, pdl):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("grpo_bench::pdl_rope_window_attention", mutates_args=("k_cache", "v_cache"))
def pdl_rope_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The decode attention kernel launched with programmatic dependent launch (the torch
    operations off a GPU)."""
    from grpo_plugins.generators.decode_attention import rope_window_attention, run_rope_kernel

    if q.device.type != "cuda":
        return rope_window_attention(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale)
    return run_rope_kernel(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale, pdl=True)


@pdl_rope_window_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale):  # type: ignore[no-untyped-def]
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    return q.new_empty(B, Hkv, Hq // Hkv, D)


def make_decode_layer(pdl: bool) -> Any:
    """The static generator's decode layer (``decode_layer``, merged layers) with every product
    by :func:`swapped_mm`, launched with PDL when ``pdl`` (then the attention too; compile it
    with inductor's ``triton.enable_pdl`` for its own kernels)."""
    from grpo_plugins.generators.decode_attention import fused_rope_window_attention, rope_window_attention

    def decode_layer(parts, layer, h, pending, cos, sin, k_all, v_all, bias, index):  # type: ignore[no-untyped-def]
        attend = pdl_rope_window_attention if pdl else fused_rope_window_attention if parts.fused_attention else rope_window_attention
        B = h.shape[0]
        h = h + pending
        attn, mlp = layer.self_attn, layer.mlp
        qkv = swapped_mm(layer.input_layernorm(h).reshape(B, -1), attn.qkv_proj.weight, attn.qkv_proj.bias, pdl)
        q, k, v = qkv.split(attn.qkv_sizes, dim=-1)
        q = q.view(B, parts.num_heads, parts.head_dim)
        k, v = k.view(B, parts.num_kv_heads, parts.head_dim), v.view(B, parts.num_kv_heads, parts.head_dim)
        o = attend(q, k, v, cos[:, 0], sin[:, 0], k_all, v_all, index, bias, parts.scaling)
        h = h + swapped_mm(o.reshape(B, -1), attn.o_proj.weight, attn.o_proj.bias, pdl).view(B, 1, -1)
        gate, up = swapped_mm(layer.post_attention_layernorm(h).reshape(B, -1), mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, pdl).chunk(2, dim=-1)
        return h, swapped_mm(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias, pdl).view(B, 1, -1)

    return decode_layer


def rows_product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, stages: int, pdl: bool) -> torch.Tensor:
    """``out`` = x @ w.T by :func:`_rows_product_kernel` (x: ROWS rows; N a multiple of block_n,
    K of block_k)."""
    N, K = w.shape
    assert x.shape == (ROWS, K) and N % block_n == 0 and K % block_k == 0, (x.shape, w.shape, block_n, block_k)
    extra = {"launch_pdl": True} if pdl else {}
    _rows_product_kernel[(N // block_n,)](
        x, w, out, K, x.stride(0), w.stride(0), out.stride(0), M=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        num_warps=4, num_stages=stages, **extra,
    )
    return out


def layer_weights(shape: str, layers: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    H, Q, I = SHAPES[shape]
    scale = H**-0.5

    def rand(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=device) * scale).to(torch.bfloat16)

    return [(rand(Q, H), rand(H, H), rand(2 * I, H), rand(H, I)) for _ in range(layers)]


def chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], product: Any, buffers: list[torch.Tensor]) -> torch.Tensor:
    """q/k/v -> o -> gate/up -> down through every layer; each product reads the one before's output."""
    H = x.shape[1]
    for i, (qkv, o, gate_up, down) in enumerate(weights):
        a = product(x, qkv, buffers[0], 0)
        b = product(a[:, :H], o, buffers[1], 1)
        c = product(b, gate_up, buffers[2], 2)
        x = product(c[:, : down.shape[1]], down, buffers[3 + i % 2], 3)
    return x


def kernel_chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], norm: torch.Tensor, pdl: bool, configs: dict[str, dict[str, int]]) -> torch.Tensor:
    """The decode layer's kernels of ``bench/decode_kernels.py`` without the
    attention: add + norm, q/k/v, o (partial sums), add + norm, gate/up with SiLU-multiply, down
    (partial sums), through every layer. ``configs``: launch settings by product (qkv, o, gate_up, down)."""
    from bench import decode_kernels as dk

    H = x.shape[1]
    h, pending = x, torch.zeros(1, *x.shape, device=x.device, dtype=x.dtype)
    for qkv, o, gate_up, down in weights:
        h, a = dk.run_add_rms_norm(h, pending, None, norm, 1e-6, pdl)
        a = dk.product(a, qkv, pdl=pdl, config=configs.get("qkv"))
        parts = dk.product(a[:, :H], o, split_out=True, pdl=pdl, config=configs.get("o"))
        h, a = dk.run_add_rms_norm(h, parts, None, norm, 1e-6, pdl)
        a = dk.product(a, gate_up, gated=True, pdl=pdl, config=configs.get("gate_up"))
        pending = dk.product(a, down, split_out=True, pdl=pdl, config=configs.get("down"))
    return dk.run_add_rms_norm(h, pending, None, norm, 1e-6, pdl)[0]


def _kernel_configs(spec: str) -> dict[str, dict[str, int]]:
    """``product:block_n,split,stages[,pre[,peel]][;...]`` (e.g. ``gate_up:32,1,3,2,1;down:32,7,4``)
    -> configs; ``*`` for every product, ``-`` for the plan's value; pre: weight blocks loaded
    before the PDL wait where peel is 1 (the K loop's first blocks outside it)."""
    configs: dict[str, dict[str, int]] = {}
    for part in filter(None, spec.split(";")):
        name, values = part.split(":")
        fields = zip(("block_n", "split", "num_stages", "pre", "peel"), values.split(","))
        config = {key: int(value) for key, value in fields if value != "-"}  # "-": the plan's
        for product in ("qkv", "o", "gate_up", "down") if name == "*" else (name,):
            configs[product] = config
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--configs", nargs="*", default=["32,128,4"])
    parser.add_argument("--swapped", nargs="*", default=["64,128,4", "64,128,3", "64,256,3"], help="BLOCK_N,BLOCK_K,STAGES of the swapped-operand kernel")
    parser.add_argument("--kernels", nargs="*", default=[], help="decode_kernels' chain (with its two add-norms per layer) "
                        "under these launch settings: 'plan' (its own) or 'product:block_n,split,stages;...' overrides")
    args = parser.parse_args()
    assert torch.cuda.is_available() and triton is not None, "needs a CUDA GPU with Triton"
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    for shape in args.shape:
        H, Q, I = SHAPES[shape]
        weights = layer_weights(shape, args.layers, "cuda")
        weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
        x = torch.randn(ROWS, H, device="cuda").to(torch.bfloat16)
        widths = (Q, H, 2 * I, H, H)
        buffers = [torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16) for n in widths]

        def cublas(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, which: int) -> torch.Tensor:
            return torch.mm(a, w.t(), out=out)

        reference = chain(x, weights, cublas, buffers).float().clone()
        row: dict[str, Any] = {"shape": shape, "layers": args.layers, "weights_MB": weight_bytes / 1e6}
        row["cublas_us"] = graph_time_us([lambda: chain(x, weights, cublas, buffers)], repeats=20)
        parts = torch.empty(16 * ROWS * max(widths), device="cuda", dtype=torch.float32)
        for spec in args.swapped:
            block_n, block_k, stages = (int(v) for v in spec.split(","))
            for pdl in (False, True):
                name = f"swapped{'-pdl' if pdl else ''}[{spec}]"

                def product(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, which: int, bn=block_n, bk=block_k, st=stages, p=pdl) -> torch.Tensor:
                    return swapped_product(a, w, out, parts, bn, bk, st, p)

                try:
                    got = chain(x, weights, product, buffers).float()
                    row[f"{name}_us"] = graph_time_us([lambda: chain(x, weights, product, buffers)], repeats=20)
                    row[f"{name}_error"] = ((got - reference).abs().max() / reference.abs().max()).item()
                except Exception as error:
                    row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        norm = torch.rand(H, device="cuda").to(torch.bfloat16) + 0.5
        for spec in args.kernels:
            configs = {} if spec == "plan" else _kernel_configs(spec)
            for pdl in (False, True):
                name = f"kernels{'-pdl' if pdl else ''}[{spec}]"
                try:
                    kernel_chain(x, weights, norm, pdl, configs)
                    row[f"{name}_us"] = graph_time_us([lambda: kernel_chain(x, weights, norm, pdl, configs)], repeats=20)
                except Exception as error:
                    row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        for spec in args.configs:
            block_n, block_k, stages = (int(v) for v in spec.split(","))
            for pdl in (False, True):
                name = f"triton{'-pdl' if pdl else ''}[{spec}]"

                def product(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, which: int, bn=block_n, bk=block_k, st=stages, p=pdl) -> torch.Tensor:
                    return rows_product(a, w, out, 64 if which == 2 else bn, bk, st, p)

                try:
                    got = chain(x, weights, product, buffers).float()
                    row[f"{name}_us"] = graph_time_us([lambda: chain(x, weights, product, buffers)], repeats=20)
                    row[f"{name}_error"] = ((got - reference).abs().max() / reference.abs().max()).item()
                except Exception as error:  # a launch option or setting this Triton refuses
                    row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        floor_us = weight_bytes / 3.35e12 * 1e6
        print(f"{shape}: {args.layers} layers, {weight_bytes / 1e6:.0f} MB of weights (floor at 3.35 TB/s: {floor_us / args.layers:.1f} us per layer)")
        for key, value in row.items():
            if key.endswith("_us"):
                print(f"  {key[:-3]:28} {value / args.layers:7.1f} us per layer  {weight_bytes / value / 1e6:5.2f} TB/s  "
                      f"max rel. diff {row.get(key[:-3] + '_error', 0.0)}", flush=True)
            elif key.endswith("_error") and isinstance(value, str):
                print(f"  {key[:-6]:28} failed: {value}", flush=True)
        results.append(row)
        del weights
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        write_json(Path(os.environ["OUT"]) / "pdl_chain.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
