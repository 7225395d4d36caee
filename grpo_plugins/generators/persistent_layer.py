"""The static generator's decode layer as one persistent Triton kernel (``persistent_layers``).

At 64 rows every kernel of a decode step pays a fixed few microseconds (launch, the ramp until
its first loads return, the tail while its last programs finish) besides streaming its bytes;
a small model's step is mostly such costs (0.5B: ten kernels per layer, ~245 per step). Here
one program per multiprocessor runs the whole layer (:mod:`~grpo_plugins.generators.persistent_kernels`),
its phases separated by grid-wide barriers. Each phase's work is cut into at most as many items
as programs: row ranges of a weight that need not be powers of two (the tile is, and masks the
rest), times parts of K for the products stored as partial sums.

Measured on an H100 (64 rows x 1024 tokens): Qwen2.5-0.5B 1.324 against 1.397 ms per token; not
faster at 1.5B, slower on SmolLM2-135M at 128 rows. A barrier waits for every program, so the kernel needs the whole GPU at
once; a barrier that waited too long gives up and raises a flag that :func:`check_barriers`
turns into an error after the generation, instead of hanging.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.decode_attention import fused_attention_unsupported
from grpo_plugins.generators.persistent_kernels import SPIN_LIMIT, STAMPS, triton
from grpo_plugins.generators.static_layers import MergedLayer
from grpo_plugins.generators.static_steps import decode_head, decode_layer

#: Keys per block of the attention's loop; depth of the products' K blocks; launch settings.
BLOCK_W = 64
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 4
#: The most rows a step may have: they are one tile of every product.
MAX_ROWS = 128
#: Largest accumulator of a product (weight rows x step rows, float32; two for gate/up): it lives
#: in registers. 128 weight rows at 64 step rows, 64 at 128.
MAX_TILE_ELEMENTS = 128 * 64
#: Programs per launch (None: one per multiprocessor); the CPU tests use a few so that each
#: program takes several items.
PROGRAMS: int | None = None
#: Record each program's time at the start, at every barrier and at the end (:func:`phase_times`).
TIMES = False
PHASES = ("norm1", "qkv", "attention", "o", "norm2", "gate_up", "down")


def _tile(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def whole_items(N: int, programs: int) -> dict[str, int]:
    """Row ranges of an (N, K) weight whose sums stay whole (one part of K): as many equal
    ranges as programs, each in the smallest power-of-two tile that holds it."""
    rows = -(-N // programs)
    return {"rows": rows, "k_per_split": 0, "groups": -(-N // rows), "splits": 1, "block_n": _tile(rows)}


def _max_tile(M: int) -> int:
    """The most weight rows a tile may have beside M step rows."""
    return MAX_TILE_ELEMENTS // max(16, 1 << (max(M, 1) - 1).bit_length())


def split_items(M: int, N: int, K: int, programs: int, block_k: int | None = None, min_parts: int = 1) -> dict[str, int]:
    """Row ranges times parts of K for a product stored as partial sums, at most ``programs``
    items: the split that loads the fewest bytes per program, counting the weight's rows, half
    of the input's (it comes from L2, not memory) and the partial sums' writing and reading;
    at least ``min_parts`` parts of K where K has as many blocks."""
    block_k = block_k or BLOCK_K
    blocks = K // block_k
    best: tuple[float, dict[str, int]] | None = None
    for parts in range(min(min_parts, blocks), min(16, blocks) + 1):
        per_part = -(-blocks // parts)
        splits = -(-blocks // per_part)
        if splits > programs:
            break
        rows = -(-N * splits // programs)
        while -(-N // rows) * splits > programs:
            rows += 1
        if _tile(rows) > _max_tile(M):
            continue
        depth = per_part * block_k
        cost = rows * depth * 2 + 0.5 * max(16, M) * depth * 2 + splits * M * N * 4 * 2 / programs
        if best is None or cost < best[0]:
            best = (cost, {"rows": rows, "k_per_split": depth, "groups": -(-N // rows), "splits": splits, "block_n": _tile(rows)})
    if best is None:
        raise ValueError(f"no split of a ({N}, {K}) weight fits {programs} programs in tiles of at most {_max_tile(M)} rows")
    return best[1]


@functools.lru_cache(maxsize=None)
def layer_plan(M: int, H: int, QD: int, NQKV: int, I: int, programs: int, qkv_split: bool = True, block_k: int = BLOCK_K) -> dict[str, dict[str, int]]:
    """Every product's items for a layer of hidden size H, query width QD (heads x head dim),
    q/k/v width NQKV and MLP width I (``qkv_split``: q/k/v as partial sums over at least two
    parts of K, summed by the attention phase: each program then reads a slice of the normed
    input instead of all of it)."""
    if H % block_k or I % block_k or QD % block_k:
        raise ValueError(f"hidden, query and MLP sizes must be multiples of {block_k}")
    plan = {
        "qkv": split_items(M, NQKV, H, programs, block_k, min_parts=2) if qkv_split else whole_items(NQKV, programs),
        "o": split_items(M, H, QD, programs, block_k),
        "gate_up": whole_items(I, programs),
        "down": split_items(M, H, I, programs, block_k),
    }
    if max(items["block_n"] for items in plan.values()) > _max_tile(M):
        raise ValueError(f"{M} rows a step allow tiles of at most {_max_tile(M)} weight rows: more programs than this GPU's {programs}")
    return plan


def _programs(device: torch.device) -> int:
    if PROGRAMS is not None:
        return PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


_SYNC: dict[torch.device, torch.Tensor] = {}
_TIMES: dict[torch.device, torch.Tensor] = {}
_LAYER_SLOTS: dict[int, int] = {}


def _sync_counters(device: torch.device) -> torch.Tensor:
    """The barriers' arrival count and gave-up flag on ``device`` (made before any graph capture:
    :func:`persistent_layers_fault` runs first)."""
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return _SYNC[device]


def check_barriers(device: torch.device) -> None:
    """After a generation: an error if a barrier of a persistent layer gave up waiting (its
    results are then wrong), naming the setting."""
    sync = _SYNC.get(device)
    if sync is not None and int(sync[1]) != 0:
        sync[1] = 0
        raise GRPOPluginsError(
            f"generator 'static': persistent_layers: a layer's {_programs(device)} programs could not all run at once on "
            f"{device} (is the GPU shared, e.g. through MPS?); this generation is void; set persistent_layers: false"
        )


def _times_buffer(device: torch.device, layer: Any, programs: int) -> torch.Tensor:
    slot = _LAYER_SLOTS.setdefault(id(layer), len(_LAYER_SLOTS))
    if device not in _TIMES or _TIMES[device].shape[0] <= slot:
        old = _TIMES.get(device)
        _TIMES[device] = torch.zeros(max(64, 2 * slot + 2), programs, STAMPS, dtype=torch.int64, device=device)
        if old is not None:
            _TIMES[device][: old.shape[0]] = old
    return _TIMES[device][slot]


def phase_times() -> dict[str, dict[str, float]]:
    """With :data:`TIMES`, from the last step, averaged over the layers, in microseconds: each
    phase's ``work`` (the median program's time between the barriers around it) and ``span``
    (first program in to last program out: work + imbalance), each barrier's ``release`` (last
    arrival to last departure)."""
    if not _TIMES:
        return {}
    t = next(iter(_TIMES.values()))[: len(_LAYER_SLOTS)].double() / 1000.0  # (layers, programs, stamps) us
    out: dict[str, dict[str, float]] = {}
    for p, name in enumerate(PHASES):
        start, end = t[:, :, 2 * p], t[:, :, 2 * p + 1] if p < 6 else t[:, :, 13]
        row = {"work": float((end - start).median(dim=1).values.mean()), "span": float((end.max(1).values - start.min(1).values).mean())}
        if p < 6:
            row["release"] = float((t[:, :, 2 * p + 2].max(1).values - end.max(1).values).mean())
        out[name] = row
    out["layer"] = {"span": float((t[:, :, 13].max(1).values - t[:, :, 0].min(1).values).mean())}
    return out


def norm_eps(norm: Any) -> float:
    """An RMSNorm module's epsilon."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def pending_parts(pending: torch.Tensor, B: int) -> torch.Tensor:
    """The residual stream's pending addend as (S, B, H) partial sums: the layer before's down
    product's as they are, the decode step's initial zeros (B, 1, H) as one part."""
    return pending if pending.shape[1] == B else pending.reshape(1, B, -1)


def persistent_decode_layer(
    parts: Any, layer: Any, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_all: torch.Tensor, v_all: torch.Tensor, bias: torch.Tensor, index: torch.Tensor, phases: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static decode loop's ``decode_layer`` (same arguments and residual hand-over) as one
    persistent kernel; the pending addend it returns is the down product's (S, B, H) float32
    partial sums. ``phases``: the seven phases as seven launches, without barriers."""
    from grpo_plugins.generators.persistent_kernels import layer_kernel

    B = h.shape[0]
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    H = h.shape[-1]
    Hq, Hkv, D = parts.num_heads, parts.num_kv_heads, parts.head_dim
    NQKV, I = attn.qkv_proj.weight.shape[0], mlp.down_proj.weight.shape[1]
    programs = _programs(h.device)
    plan = layer_plan(B, H, Hq * D, NQKV, I, programs, H >= 2 * BLOCK_K, BLOCK_K)
    h2d = h.reshape(B, H)
    pend = pending_parts(pending, B)
    dtype, dev = h.dtype, h.device
    h2, x, h3, x2 = (torch.empty(B, H, dtype=dtype, device=dev) for _ in range(4))
    qkv = torch.empty(B, NQKV, dtype=dtype, device=dev)
    qkv_parts = torch.empty(plan["qkv"]["splits"], B, NQKV, dtype=torch.float32, device=dev) if plan["qkv"]["splits"] > 1 else qkv
    o = torch.empty(B, Hq * D, dtype=dtype, device=dev)
    act = torch.empty(B, I, dtype=dtype, device=dev)
    o_parts = torch.empty(plan["o"]["splits"], B, H, dtype=torch.float32, device=dev)
    down_parts = torch.empty(plan["down"]["splits"], B, H, dtype=torch.float32, device=dev)
    attn_bias = bias.float().contiguous()
    W = attn_bias.shape[1]
    cos2, sin2 = (t[:, 0] for t in (cos, sin))
    cos2, sin2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos2, sin2))
    qkv_b, gu_b = attn.qkv_proj.bias, mlp.gate_up_proj.bias
    p_qkv, p_o, p_gu, p_d = plan["qkv"], plan["o"], plan["gate_up"], plan["down"]
    sync = _sync_counters(dev)
    times = TIMES and not phases
    args = (
        h2d, pend, h2d.stride(0), pend.stride(0), pend.stride(1),
        norm1.weight, norm2.weight, norm_eps(norm1), norm_eps(norm2),
        h2, x, qkv, qkv_parts, o, o_parts, h3, x2, act, down_parts,
        attn.qkv_proj.weight, attn.qkv_proj.weight if qkv_b is None else qkv_b, attn.o_proj.weight,
        mlp.gate_up_proj.weight, mlp.gate_up_proj.weight if gu_b is None else gu_b, mlp.down_proj.weight,
        cos2, sin2, k_all, v_all, index, attn_bias, W, -(-W // BLOCK_W) * BLOCK_W, parts.scaling,
        cos2.stride(0), sin2.stride(0), k_all.stride(0), k_all.stride(1), k_all.stride(2),
        v_all.stride(0), v_all.stride(1), v_all.stride(2), attn_bias.stride(0),
        B, H, NQKV, I,
        p_qkv["rows"], p_qkv["k_per_split"] or H, p_qkv["groups"], p_qkv["groups"] * p_qkv["splits"],
        p_o["rows"], p_o["k_per_split"], p_o["groups"], p_o["groups"] * p_o["splits"],
        p_gu["rows"], p_gu["groups"], p_gu["groups"],
        p_d["rows"], p_d["k_per_split"], p_d["groups"], p_d["groups"] * p_d["splits"],
        sync, _times_buffer(dev, layer, programs) if times else sync,
    )
    G = Hq // Hkv
    constants = dict(
        NPROG=programs, TIMES=times, BLOCK_M=max(16, triton.next_power_of_2(B)), BLOCK_H=triton.next_power_of_2(H),
        BN_QKV=p_qkv["block_n"], BN_O=p_o["block_n"], BN_GU=p_gu["block_n"], BN_D=p_d["block_n"], BLOCK_K=BLOCK_K,
        HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_W=BLOCK_W,
        QKV_BIAS=qkv_b is not None, GU_BIAS=gu_b is not None, PENDING_SPLITS=pend.shape[0], O_SPLITS=p_o["splits"],
        QKV_SPLITS=p_qkv["splits"], BLOCK_QG=triton.next_power_of_2(G * D), SPIN=SPIN_LIMIT,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    for only in range(7) if phases else (-1,):
        layer_kernel[(programs,)](*args, ONLY=only, **constants)
    return h3.view(B, 1, H), down_parts


def persistent_decode_head(
    parts: Any, st: Any, s: Any, pad_id: int, stop_at_eos: bool, h: torch.Tensor, pending: torch.Tensor
) -> None:
    """The static loop's ``decode_head`` after :func:`persistent_decode_layer` layers: their last
    pending partial sums added up, rounded, then the final norm of the residual stream, the LM
    head and sampling."""
    B = h.shape[0]
    decode_head(parts, st, s, pad_id, stop_at_eos, h, pending_parts(pending, B).sum(0).to(h.dtype).view_as(h))


def persistent_layers_unsupported(parts: Any, rows: int) -> str | None:
    """Why ``rows`` rows of these decoder parts cannot decode with :func:`persistent_decode_layer`
    (None: they can): it takes merged 16-bit layers of RMSNorms, SiLU-gated MLPs and attention
    without query/key norms or o/down biases, on an Ampere or newer CUDA GPU, at most
    :data:`MAX_ROWS` rows."""
    weight = parts.embed.weight
    groups = parts.num_heads // parts.num_kv_heads
    reason = fused_attention_unsupported(weight.device, parts.head_dim, groups, weight.dtype)
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(weight.device)[0] < 8:
        return "it needs an Ampere or newer GPU"
    if rows > MAX_ROWS:
        return f"it takes at most {MAX_ROWS} rows a step, not {rows} (set max_batch_rows)"
    for layer in parts.layers:
        if not isinstance(layer, MergedLayer) or layer.self_attn.qkv_proj.fp8:
            return "it needs the merged 16-bit weight copies (merge_weights, without fp8)"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None or attn.k_norm is not None:
            return "the layers have query/key norms"
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return "the o or down projection has a bias"
        probe = torch.linspace(-4, 4, 9)
        if not torch.allclose(mlp.act_fn(probe), torch.nn.functional.silu(probe)):
            return "the MLP's activation is not SiLU"
    layer = parts.layers[0]
    H, I = layer.mlp.down_proj.weight.shape
    try:
        layer_plan(rows, H, parts.num_heads * parts.head_dim, layer.self_attn.qkv_proj.weight.shape[0], I, _programs(weight.device))
    except ValueError as error:
        return str(error)
    return None


_FAULTS: dict[tuple[Any, ...], str | None] = {}


def persistent_layers_fault(parts: Any, rows: int) -> str | None:
    """Why the kernel cannot be trusted for this model on its device (None: on the model's first
    layer, with random inputs and a random cache window of several blocks, it computes what the
    torch decode layer computes; its barriers did not give up). Checked once per device, dtype
    and layer shape."""
    layer = parts.layers[0]
    weight = layer.self_attn.qkv_proj.weight
    key = (weight.device, weight.dtype, tuple(weight.shape), tuple(layer.mlp.down_proj.weight.shape), rows)
    if key in _FAULTS:
        return _FAULTS[key]
    g = torch.Generator(device="cpu").manual_seed(0)
    dev, dtype, H = weight.device, weight.dtype, layer.mlp.down_proj.weight.shape[0]
    S, cur = 3 * BLOCK_W, 2 * BLOCK_W + 5
    h = torch.randn(rows, 1, H, generator=g).to(dev, dtype)
    pending = torch.randn(rows, 1, H, generator=g).to(dev, dtype)
    cache = torch.randn(2, rows, parts.num_kv_heads, S, parts.head_dim, generator=g).to(dev, dtype)
    cos, sin = parts.rotary(h, torch.full((rows, 1), cur, device=dev))
    bias = torch.zeros(rows, S, device=dev).masked_fill(torch.arange(S, device=dev) > cur, float("-inf"))
    index = torch.tensor([cur], device=dev)
    sync = _sync_counters(dev)
    try:
        with torch.no_grad():
            want_h, want_pending = decode_layer(parts, layer, h, pending, cos, sin, cache[0].clone(), cache[1].clone(), bias, index)
            have_h, have_parts = persistent_decode_layer(parts, layer, h, pending, cos, sin, cache[0].clone(), cache[1].clone(), bias, index)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    except Exception as error:  # a Triton or driver that cannot build or launch it
        fault: str | None = f"the kernel does not run ({type(error).__name__}: {error})"
    else:
        want = (want_h + want_pending).float()
        have = (have_h + have_parts.sum(0).to(dtype).view_as(have_h)).float()
        gap = (have - want).abs().max().item()
        fault = None
        if int(sync[1]) != 0:
            sync[1] = 0
            fault = f"its {_programs(dev)} programs could not all run at once (is the GPU shared?)"
        elif not torch.allclose(have, want, rtol=3e-2, atol=3e-2 * want.abs().max().item()):
            fault = f"its layer output differs from the torch layer's by {gap:.3g}"
    _FAULTS[key] = fault
    return fault


def use_persistent_layers(parts: Any, rows: int, wanted: bool | None) -> bool:
    """Whether ``rows`` rows of these decoder parts decode with :func:`persistent_decode_layer`:
    ``wanted``, or where it can run and passes :func:`persistent_layers_fault`'s check when None;
    True where it cannot is an error naming the setting."""
    if wanted is False:
        return False
    reason = persistent_layers_unsupported(parts, rows)
    if reason is None:
        reason = persistent_layers_fault(parts, rows)
    if reason is not None and wanted:
        raise GRPOPluginsError(f"generator 'static': persistent_layers cannot run here: {reason}; set persistent_layers: false")
    return reason is None
