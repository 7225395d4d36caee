"""A candidate for the decode step's projections (bench only, until timed on a GPU): 8-bit integer
weights with one scale per output channel, read by a Triton kernel made for a small batch.

Every float8 route through torch's own kernels ran slower than bf16 at 64 rows on the H200
(cuBLASLt's float8 tile is 128 rows; inductor did not fuse the widening into its Triton product;
bench/RESULTS.md). This kernel streams the int8 weight (N, K) once, widens it to bf16 in
registers and multiplies by the 16-bit input (M <= 128 rows, all in one tile), so a step reads
one byte per weight. Products with few output blocks split K over several programs (float32
partial sums, then one reduction) so that every SM streams.

``python bench/profile_decode.py --shape qwen2.5-7b --lora 16 --variants dynamic int8w``

Run as a script, it times the kernel alone against the bf16 product (``F.linear``, cuBLAS) on
the fused projections of a decode step (64 rows; Qwen2.5-7B and 1.5B shapes) and prints each
one's weight bandwidth:

``python bench/int8_decode.py [--rows 64]``
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: The most rows one kernel call takes (all in one tile); a decode batch is 64 rows or fewer.
MAX_ROWS = 128


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) as int8 with one float32 scale per row: ``(w8, scale)``, ``weight ~= w8 * scale[:, None]``."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def reference_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: ``(x @ w8^T) * scale`` in float32, rounded to ``x``'s dtype."""
    return ((x.float() @ w8.float().t()) * scale).to(x.dtype)


if triton is not None:

    @triton.jit
    def _int8_weight_mm(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
            acc += tl.dot(x, w.to(x.dtype))
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _plan(N: int, K: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, split): enough programs to fill ``programs`` SM slots."""
    block_n, block_k = 64, 128
    blocks = -(-N // block_n)
    split = 1
    while blocks * split < programs and K // (block_k * split * 2) >= 2:
        split *= 2
    return block_n, block_k, split


@functools.lru_cache(maxsize=None)
def _sm_slots(device_index: int) -> int:
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def int8_weight_mm(
    x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, programs: int | None = None, config: dict[str, int] | None = None
) -> torch.Tensor:
    """``x`` (M, K) 16-bit, ``w8`` (N, K) int8, ``scale`` (N,) float32 -> (M, N) in ``x``'s dtype.
    ``config`` (the sweep): ``block_n``, ``block_k``, ``split``, ``num_warps``, ``num_stages``
    instead of the planned ones."""
    M, K = x.shape
    N = w8.shape[0]
    if triton is None or M > MAX_ROWS:
        return reference_mm(x, w8, scale)
    if programs is None:
        programs = _sm_slots(x.device.index or 0) if x.is_cuda else 1
    block_n, block_k, split = _plan(N, K, programs)
    launch: dict[str, int] = {}
    if config:
        block_n, block_k, split = config.get("block_n", block_n), config.get("block_k", block_k), config.get("split", split)
        launch = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
    k_per_split = -(-K // (split * block_k)) * block_k
    block_m = max(16, triton.next_power_of_2(M))
    # One split writes the result in x's dtype (the store rounds); several write float32 partials.
    out = torch.empty(split, M, N, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), split)
    _int8_weight_mm[grid](
        x.contiguous(), w8, scale, out, M, N, K, k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


@torch.library.custom_op("grpo_bench::int8_weight_mm", mutates_args=())
def int8_weight_mm_op(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`int8_weight_mm` as an opaque op, so ``torch.compile`` calls it as it is."""
    return int8_weight_mm(x, w8, scale)


@int8_weight_mm_op.register_fake
def _(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w8.shape[0]))


class Int8WeightLinear(torch.nn.Module):
    """A fused projection (:class:`~grpo_plugins.generators.static_layers.FusedLinear`) read as
    int8 weights with per-channel scales. A static copy: it does not follow weight updates."""

    def __init__(self, fused: Any) -> None:
        super().__init__()
        w8, scale = quantize_int8(fused.weight)
        self.register_buffer("weight", w8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if fused.bias is None else fused.bias.detach().clone())
        self.sizes = fused.sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_weight_mm_op(x.reshape(-1, x.shape[-1]), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_int8_weights(merged_layers: list[Any]) -> None:
    """Swap every fused projection of ``merged_layers`` (the static decoder's merged copies) for
    an :class:`Int8WeightLinear`."""
    for layer in merged_layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = Int8WeightLinear(attn.qkv_proj), Int8WeightLinear(attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = Int8WeightLinear(mlp.gate_up_proj), Int8WeightLinear(mlp.down_proj)


#: (name, N, K) of the fused decode projections: q/k/v, o, gate/up, down.
SHAPES = {
    "qwen2.5-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "qwen2.5-1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)],
}


def _sweep_configs(N: int, K: int) -> list[dict[str, int]]:
    """Launch settings to try for one product: tile width and depth, K splits, pipeline stages."""
    configs = []
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            blocks = -(-N // block_n)
            for split in (1, 2, 4, 8):
                if K // (block_k * split) < 1 or (split > 1 and blocks >= 264):
                    continue
                for num_stages in (3, 5):
                    configs.append(
                        {"block_n": block_n, "block_k": block_k, "split": split, "num_warps": 4, "num_stages": num_stages}
                    )
    return configs


def _time_us(fn: Any, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()  # replayed, as the decode step is: no launch gaps
    with torch.cuda.graph(graph):
        fn()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--no-sweep", action="store_true", help="time the planned launch only")
    args = parser.parse_args()
    assert torch.cuda.is_available() and triton is not None, "needs a CUDA GPU and Triton"
    torch.manual_seed(0)
    rows = []
    for model, shapes in SHAPES.items():
        for name, N, K in shapes:
            x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            w8, scale = quantize_int8(w)
            got, want = int8_weight_mm(x, w8, scale), reference_mm(x, w8, scale)
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            bf16_us = _time_us(lambda: torch.nn.functional.linear(x, w))
            int8_us = _time_us(lambda: int8_weight_mm(x, w8, scale))
            row = {
                "model": model, "product": name, "N": N, "K": K, "bf16_us": bf16_us, "int8_us": int8_us,
                "bf16_TBps": N * K * 2 / bf16_us / 1e6, "int8_TBps": N * K / int8_us / 1e6, "rel_err": err,
                "split": _plan(N, K, _sm_slots(0))[2],
            }
            if not args.no_sweep:
                best = None
                for config in _sweep_configs(N, K):
                    try:
                        us = _time_us(lambda: int8_weight_mm(x, w8, scale, config=config), repeats=50)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                        print(f"    {config}: {type(exc).__name__}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, config)
                if best is not None:
                    row["best_us"], row["best_config"] = best
                    row["best_TBps"] = N * K / best[0] / 1e6
            rows.append(row)
            print(
                f"{model:13} {name:8} {N:6}x{K:<6} bf16 {bf16_us:7.1f} us ({row['bf16_TBps']:.2f} TB/s)  "
                f"int8 {int8_us:7.1f} us ({row['int8_TBps']:.2f} TB/s, split {row['split']})  rel err {err:.1e}",
                flush=True,
            )
            if "best_us" in row:
                print(f"{'':22} best {row['best_us']:7.1f} us ({row['best_TBps']:.2f} TB/s) {row['best_config']}", flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "int8_decode.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": args.rows, "products": rows}, f, indent=1)


if __name__ == "__main__":
    main()
