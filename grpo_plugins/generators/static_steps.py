"""The fixed-shape pieces of the static decode loop: sampling from logits, the prompt pass
(:func:`prefill`) and one decode step over the static KV cache (:class:`DecodeState`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from grpo_plugins.generators.decode_attention import fused_rope_window_attention, rope_window_attention, rotate_half
from grpo_plugins.generators.static_layers import DecoderParts
from grpo_plugins.kinds import SamplingSettings


def bucket(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return max(multiple, math.ceil(n / multiple) * multiple)


def batch_bucket(n: int) -> int:
    """The batch rows a graph is built for: the next power of two, at least 8."""
    return max(8, 1 << (max(n, 1) - 1).bit_length())


def attention_windows(P: int, T: int, step: int = 128, most: int = 16) -> list[int]:
    """The attention windows (cache slots read) of the decode graphs for prompts of ``P`` and
    completions of ``T`` tokens: ``P + step``, ``P + 2 step``, ... up to ``P + T - 1`` (the last
    token fed back sits at cache index ``P + T - 2``), the step widened so that there are at
    most ``most`` windows. Every window is narrower than the cache (``P + T`` slots), so one
    compiled layer serves them all: a window as wide as the cache would be traced differently."""
    n = max(1, T - 1)
    step = max(step, math.ceil(n / most))
    return [P + min(n, j * step) for j in range(1, math.ceil(n / step) + 1)]


def process_logits(logits: torch.Tensor, seen: torch.Tensor | None, s: SamplingSettings) -> torch.Tensor:
    """Apply transformers' logits processors in ``generate``'s order: repetition penalty,
    temperature, top-k, top-p, min-p. ``logits`` (B, V) float32; ``seen`` (B, V) bool marks the
    tokens of prompt and completion so far (needed only with a repetition penalty)."""
    neg_inf = float("-inf")
    if s.repetition_penalty != 1.0 and seen is not None:
        penalised = torch.where(logits < 0, logits * s.repetition_penalty, logits / s.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if s.temperature != 1.0:
        logits = logits / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - s.top_p)
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if s.min_p is not None and s.min_p > 0:
        probs = logits.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        drop = probs < s.min_p * top
        drop = drop.scatter(1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(drop, neg_inf)
    return logits


def _chunk_count(vocab: int, most: int = 64) -> int:
    """The largest divisor of ``vocab`` up to ``most``: how many slices a row's reduction is
    split into."""
    return next(c for c in range(min(most, vocab), 0, -1) if vocab % c == 0)


def sample_tokens(
    logits: torch.Tensor, seen: torch.Tensor | None, s: SamplingSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from the processed distribution.

    Returns the tokens (B,) and their log-probabilities under the distribution actually sampled
    from (after penalty, temperature and filters), (B,) float32. Sampling is the Gumbel-max trick
    (``argmax(log p - log E)``, ``E ~ Exp(1)``), which needs no host sync and captures in a graph.

    It samples in two stages, exactly as from the whole row: a slice of the vocabulary with
    probability its share of the mass, then a token of that slice with probability its share of
    the slice. Each stage is a Gumbel-max over few values, so a step draws B * (C + V / C)
    random numbers instead of B * V: with ~150k logits per row, generating the noise was most of
    the step's sampling time (0.1 ms at 64 rows on an H200)."""
    x = process_logits(logits, seen, s)  # (B, V) float32
    B, V = x.shape
    C = _chunk_count(V)
    L = V // C
    xs = x.view(B, C, L)
    top = xs.amax(dim=-1)  # (B, C); -inf where a whole slice is filtered out
    shift = torch.where(torch.isfinite(top), top, 0.0)
    log_mass = (xs - shift[..., None]).exp().sum(dim=-1).log() + top  # (B, C); -inf for an empty slice
    row_top = top.amax(dim=-1, keepdim=True)  # (B, 1); finite: the filters keep the most likely token
    logsumexp = row_top.squeeze(1) + (log_mass - row_top).exp().sum(dim=-1).log()  # (B,)
    chunk = (log_mass - torch.empty_like(log_mass).exponential_().log()).argmax(dim=-1, keepdim=True)  # (B, 1)
    inside = xs.gather(1, chunk[..., None].expand(B, 1, L)).squeeze(1)  # (B, L)
    where = (inside - torch.empty_like(inside).exponential_().log()).argmax(dim=-1)  # (B,)
    tokens = chunk.squeeze(1) * L + where
    return tokens, x.gather(1, tokens[:, None]).squeeze(1) - logsumexp


def _embed(parts: DecoderParts, ids: torch.Tensor) -> torch.Tensor:
    # ``forward`` skips module hooks: gradient checkpointing registers one on the embedding that
    # calls requires_grad_(), which torch.compile cannot trace and generation does not need.
    return parts.embed.forward(ids)


def _projections(layer: Any, h: torch.Tensor, parts: DecoderParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Q, Hq, D), k/v (B, Q, Hkv, D) for hidden states ``h`` (B, Q, H), before RoPE."""
    attn = layer.self_attn
    B, Q, _ = h.shape
    if hasattr(attn, "qkv_proj"):  # a MergedLayer: one product for q, k and v
        q, k, v = attn.qkv_proj(h).split(attn.qkv_sizes, dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q = q.view(B, Q, parts.num_heads, parts.head_dim)
    k = k.view(B, Q, parts.num_kv_heads, parts.head_dim)
    v = v.view(B, Q, parts.num_kv_heads, parts.head_dim)
    if getattr(attn, "q_norm", None) is not None:  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _qkv(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: DecoderParts):
    """Projections with RoPE for hidden states ``h`` (B, Q, H) -> q (B, Hq, Q, D), k/v (B, Hkv, Q, D)."""
    q, k, v = _projections(layer, h, parts)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, Q, D)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def prefill(
    parts: DecoderParts,
    input_ids: torch.Tensor,
    key_valid: torch.Tensor,
    positions: torch.Tensor,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
) -> torch.Tensor:
    """Run the left-padded prompts ``input_ids`` (B, P) through the model, write their keys and
    values into the per-layer caches ``k_cache``/``v_cache`` (each (B, Hkv, S, D)) at positions
    [0, P), and return the float32 logits of the last position (B, V)."""
    B, P = input_ids.shape
    h = _embed(parts, input_ids)  # (B, P, H)
    cos, sin = parts.rotary(h, positions)  # (B, P, D)
    causal = torch.ones(P, P, dtype=torch.bool, device=h.device).tril()
    # Padding queries may see only themselves: never a fully masked row (NaN), never read later.
    mask = (causal & key_valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=h.device)
    mask = mask[:, None]  # (B, 1, P, P)
    groups = parts.num_heads // parts.num_kv_heads
    for i, layer in enumerate(parts.layers):
        x = layer.input_layernorm(h)
        q, k, v = _qkv(layer, x, cos, sin, parts)
        k_cache[i][:, :, :P] = k
        v_cache[i][:, :, :P] = v
        try:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=parts.scaling, enable_gqa=groups > 1)
        except TypeError:  # torch < 2.5 has no enable_gqa; the prompt is short, so expand here
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=parts.scaling)
        h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, P, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = parts.norm(h[:, -1:])  # (B, 1, H)
    return parts.lm_head(last)[:, 0].float()


def prefill_distinct(
    parts: DecoderParts,
    input_ids: torch.Tensor,
    key_valid: torch.Tensor,
    positions: torch.Tensor,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
) -> torch.Tensor:
    """:func:`prefill`, running each distinct prompt row once: a GRPO batch repeats every prompt
    for each of its completions, so the prefill's cost drops by that factor. The keys, values
    and last-position logits of a prompt are copied to every row that repeats it."""
    B, P = input_ids.shape
    rows = torch.cat([input_ids, key_valid.long()], dim=1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    U = distinct.shape[0]
    if U == B:
        return prefill(parts, input_ids, key_valid, positions, k_cache, v_cache)
    first = torch.empty(U, dtype=torch.long, device=input_ids.device)
    first.scatter_(0, inverse, torch.arange(B, device=input_ids.device))  # one row of each (they are equal)
    shape = (U, parts.num_kv_heads, P, parts.head_dim)
    keys = [torch.empty(shape, dtype=c.dtype, device=c.device) for c in k_cache]
    values = [torch.empty(shape, dtype=c.dtype, device=c.device) for c in v_cache]
    logits = prefill(parts, input_ids[first], key_valid[first], positions[first], keys, values)
    for cache, part in zip(k_cache + v_cache, keys + values):
        cache[:, :, :P] = part[inverse]
    return logits[inverse]


def prefill_with_images(
    model: Any,
    parts: DecoderParts,
    input_ids: torch.Tensor,
    key_valid: torch.Tensor,
    positions: torch.Tensor,
    images: dict[str, torch.Tensor],
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefill` for prompts with images: the vision-language ``model``'s own forward
    (its vision encoder, the image features in place of the placeholder tokens, its own
    positions) over the left-padded prompts, its keys and values copied into the static caches.
    Returns the float32 logits of the last position (B, V) and the position of the first
    completion token of each row (B,): after the prompt's text positions, or with sectioned
    (M-RoPE) positions after the largest position the prompt used."""
    import inspect

    from grpo_plugins.generators.common import base_model

    P = input_ids.shape[1]
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": key_valid.long(), "use_cache": True, **images}
    if not parts.sectioned_rope:  # the model would count positions from the padding otherwise
        kwargs["position_ids"] = positions
    base = base_model(model)
    if "logits_to_keep" in inspect.signature(base.forward).parameters:
        kwargs["logits_to_keep"] = 1
    owner = getattr(base, "model", None)
    if owner is not None and hasattr(owner, "rope_deltas"):
        owner.rope_deltas = None  # recomputed from these prompts
    out = model(**kwargs)
    cache = getattr(out, "cache", None)  # newer transformers' name
    if cache is None:
        cache = out.past_key_values
    for i in range(len(k_cache)):
        if hasattr(cache, "layers"):
            k, v = cache.layers[i].keys, cache.layers[i].values
        else:  # older transformers: parallel lists
            k, v = cache.key_cache[i], cache.value_cache[i]
        k_cache[i][:, :, :P] = k
        v_cache[i][:, :, :P] = v
    start = key_valid.long().sum(-1)  # (B,)
    if parts.sectioned_rope:
        deltas = getattr(out, "rope_deltas", None)
        if deltas is None and owner is not None:
            deltas = getattr(owner, "rope_deltas", None)
        if deltas is not None:
            start = start + deltas.reshape(-1).to(start.device)
    logits = out.logits[:, -1].float()
    if hasattr(parts.lm_head, "token_ids"):  # SuppressedHead: the placeholders are never sampled
        logits = logits.index_fill(-1, parts.lm_head.token_ids, float("-inf"))
    return logits, start


@dataclass
class DecodeState:
    """The fixed-address buffers one decode graph reads and writes (B rows, S cache positions,
    T completion tokens)."""

    # One tensor per layer, not one (L, ...) tensor: the compiler updates a whole graph input in
    # place, but a write into a view of one would copy the entire cache every step.
    k_cache: list[torch.Tensor]  # L x (B, Hkv, S, D)
    v_cache: list[torch.Tensor]  # L x (B, Hkv, S, D)
    key_valid: torch.Tensor  # (B, S) bool: not a prompt pad
    slots: torch.Tensor  # (S,) long: 0..S-1
    token: torch.Tensor  # (B,) long: the last sampled token, fed to the next step
    position: torch.Tensor  # (B,) long: its RoPE position
    cur: torch.Tensor  # () long: its cache index
    step: torch.Tensor  # () long: the output column of the next token
    done: torch.Tensor  # (B,) bool: finished (EOS seen, or a padding row)
    seen: torch.Tensor | None  # (B, V) bool: tokens present so far (repetition penalty only)
    eos: torch.Tensor  # (E,) long
    out_tokens: torch.Tensor  # (B, T) long
    out_logps: torch.Tensor  # (B, T) float32

    @staticmethod
    def allocate(
        parts: DecoderParts,
        B: int,
        S: int,
        T: int,
        n_eos: int,
        with_seen: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "DecodeState":
        L, Hkv, D = len(parts.layers), parts.num_kv_heads, parts.head_dim
        long = dict(dtype=torch.long, device=device)
        return DecodeState(
            # zeros, not empty: masked slots still enter the matmul with weight 0, and 0 * NaN = NaN.
            k_cache=[torch.zeros(B, Hkv, S, D, dtype=dtype, device=device) for _ in range(L)],
            v_cache=[torch.zeros(B, Hkv, S, D, dtype=dtype, device=device) for _ in range(L)],
            key_valid=torch.zeros(B, S, dtype=torch.bool, device=device),
            slots=torch.arange(S, **long),
            token=torch.zeros(B, **long),
            position=torch.zeros(B, **long),
            cur=torch.zeros((), **long),
            step=torch.zeros((), **long),
            done=torch.zeros(B, dtype=torch.bool, device=device),
            seen=torch.zeros(B, parts.vocab_size, dtype=torch.bool, device=device) if with_seen else None,
            eos=torch.zeros(n_eos, **long),
            out_tokens=torch.zeros(B, T, **long),
            out_logps=torch.zeros(B, T, dtype=torch.float32, device=device),
        )


def decode_layer(
    parts: DecoderParts,
    layer: Any,
    h: torch.Tensor,
    pending: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    bias: torch.Tensor,
    index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one new token per row: writes its key/value at cache index
    ``index`` of ``k_all``/``v_all`` (B, Hkv, S, D) and attends over the first W slots under
    ``bias`` (B, W), W <= S (the attention window of the step, see :func:`decode_step`).

    The residual stream arrives as ``h + pending`` (each (B, 1, H)): the layer before hands on
    its MLP output unadded, so that the addition and this layer's first norm are one kernel
    (the layers are separate graphs, and at small models a decode step's time is mostly its
    kernel count). Returns this layer's ``(h, pending)`` the same way. The same function serves
    every layer, so it is compiled once for the whole model."""
    B = h.shape[0]
    h = h + pending
    x = layer.input_layernorm(h)
    q, k, v = _projections(layer, x, parts)  # (B, 1, heads, D), before RoPE
    # RoPE, the cache writes and attention over the window: one kernel, or torch operations
    attend = fused_rope_window_attention if parts.fused_attention else rope_window_attention
    o = attend(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], k_all, v_all, index, bias, parts.scaling)  # (B, Hkv, G, D)
    h = h + layer.self_attn.o_proj(o.reshape(B, 1, -1))
    return h, layer.mlp(layer.post_attention_layernorm(h))


def decode_head(
    parts: DecoderParts, st: DecodeState, s: SamplingSettings, pad_id: int, stop_at_eos: bool, h: torch.Tensor, pending: torch.Tensor
) -> None:
    """The final norm (of ``h + pending``, the last layer's residual stream), LM head and
    sampling of one decode step; records the token at column ``st.step`` and advances the
    counters."""
    sample_and_record(parts, st, s, pad_id, stop_at_eos, parts.norm(h + pending))


def sample_and_record(parts: DecoderParts, st: DecodeState, s: SamplingSettings, pad_id: int, stop_at_eos: bool, x: torch.Tensor) -> None:
    """:func:`decode_head` after its final norm: the LM head on ``x`` (B, 1, H), sampling, the
    token recorded and the counters advanced."""
    logits = parts.lm_head(x)[:, 0].float()  # (B, V)
    token, logp = sample_tokens(logits, st.seen, s)
    token = torch.where(st.done, pad_id, token)
    logp = torch.where(st.done, 0.0, logp)
    st.out_tokens.index_copy_(1, st.step.view(1), token[:, None])
    st.out_logps.index_copy_(1, st.step.view(1), logp[:, None])
    if stop_at_eos:
        st.done.logical_or_((token[:, None] == st.eos).any(dim=-1))
    if st.seen is not None:
        st.seen.scatter_(1, token[:, None], True)
    st.token.copy_(token)
    st.position.add_(1)
    st.cur.add_(1)
    st.step.add_(1)


def decode_step(
    parts: DecoderParts,
    st: DecodeState,
    s: SamplingSettings,
    pad_id: int,
    stop_at_eos: bool,
    layer_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = decode_layer,
    head_fn: Callable[..., None] = decode_head,
    window: int | None = None,
) -> None:
    """One token for every row, entirely on the device and with fixed shapes (graph-capturable):
    feed ``st.token`` at cache index ``st.cur``, sample the next token, record it at column
    ``st.step``, and advance the counters. ``layer_fn`` / ``head_fn``: :func:`decode_layer` and
    :func:`decode_head` or compiled versions of them. ``window``: attend over the first
    ``window`` cache slots only (None: all S); the caller guarantees ``st.cur < window``. A step
    reads its window of the KV cache instead of all of it, which at long completions is a large
    share of a decode step's memory traffic."""
    W = st.slots.shape[0] if window is None else window
    h = _embed(parts, st.token[:, None])  # (B, 1, H)
    cos, sin = parts.rotary(h, st.position[:, None])  # (B, 1, D)
    valid = st.key_valid[:, :W] & (st.slots[:W] <= st.cur)  # (B, W)
    # float32 once per step: the attention kernel reads it so (converting it in each layer cost 28
    # copy kernels a step); the batched products cast it to the model's dtype inside their graph.
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=h.device).masked_fill(~valid, float("-inf"))  # (B, W)
    index = st.cur.view(1)
    pending = torch.zeros_like(h)
    for i, layer in enumerate(parts.layers):
        h, pending = layer_fn(parts, layer, h, pending, cos, sin, st.k_cache[i], st.v_cache[i], bias, index)
    head_fn(parts, st, s, pad_id, stop_at_eos, h, pending)
