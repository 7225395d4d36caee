"""The decode loop behind the ``static`` generator: a static KV cache, a fixed-shape decode step
(compiled and captured in a CUDA graph on GPUs) with sampling inside it.

The loop drives the Hugging Face model's own submodules (embedding, per-layer norms, q/k/v/o
projections, MLP, rotary embedding, final norm, LM head) rather than copies of their weights, so
a peft LoRA adapter is applied exactly as in training and optimizer updates (made in place) are
seen by the captured graph at once. Supported: Llama-style decoders (``llama``, ``qwen2``,
``qwen3``, ``mistral``); :func:`check_supported` says why another model is not.

Layout. Prompts are left-padded to ``P`` (a bucket), the batch to ``B`` rows (a bucket); the cache
holds ``S = P + T`` positions per layer, ``T`` = max completion length. Every decode step has the
same shapes: it writes the new key/value at cache index ``cur`` and attends over all ``S``
positions under a validity mask, which is what lets one captured graph serve every step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.common import base_model, cut_at_eos
from grpo_plugins.kinds import SamplingSettings

logger = logging.getLogger(__name__)

#: model_type values whose decoder layers this loop reproduces exactly.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


class UnsupportedModelError(GRPOPluginsError):
    """The static decode loop cannot run this model (architecture or feature not supported)."""


# -- the model's parts ---------------------------------------------------------------------------


@dataclass
class DecoderParts:
    """The submodules of a Llama-style causal LM that the decode loop calls."""

    embed: Any
    layers: list[Any]
    norm: Any
    rotary: Any
    lm_head: Any
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    vocab_size: int
    sliding_window: int | None


def check_supported(model: Any) -> DecoderParts:
    """The decoder parts of ``model``; raises :class:`UnsupportedModelError` saying why not."""
    base = base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"generator 'static' supports model types {sorted(SUPPORTED_MODEL_TYPES)}, not "
            f"'{model_type}'; use generator: transformers"
        )
    inner = getattr(base, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed):
        raise UnsupportedModelError(
            f"generator 'static': the {model_type} model lacks model.{{{', '.join(needed)}}}; "
            "use generator: transformers"
        )
    lm_head = base.get_output_embeddings()
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            "generator 'static' does not support logit soft-capping; use generator: transformers"
        )
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    window = None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        layer_types = getattr(config, "layer_types", None)
        if model_type == "mistral" or (layer_types and "sliding_attention" in layer_types):
            window = int(config.sliding_window)
    first_attn = inner.layers[0].self_attn
    return DecoderParts(
        embed=inner.embed_tokens,
        layers=list(inner.layers),
        norm=inner.norm,
        rotary=inner.rotary_emb,
        lm_head=lm_head,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scaling=float(getattr(first_attn, "scaling", head_dim**-0.5)),
        vocab_size=lm_head.weight.shape[0] if hasattr(lm_head, "weight") else config.vocab_size,
        sliding_window=window,
    )


# -- merged, fused weights for decoding -----------------------------------------------------------


def _is_lora(module: Any) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def _mergeable(module: Any) -> bool:
    """Whether ``module`` is a plain or peft LoRA linear layer whose weight is an ordinary
    floating-point tensor (not quantised) and whose LoRA delta is exactly ``get_delta_weight``
    (no DoRA, no LoRA bias)."""
    base = module.get_base_layer() if _is_lora(module) else module
    weight = getattr(base, "weight", None)
    if not isinstance(base, torch.nn.Linear) or weight is None or not weight.is_floating_point():
        return False
    if type(weight) not in (torch.nn.Parameter, torch.Tensor):  # e.g. bitsandbytes' Params4bit
        return False
    if _is_lora(module):
        for name in module.active_adapters:
            if module.use_dora.get(name, False) or getattr(module, "lora_bias", {}).get(name, False):
                return False
    return True


class FusedLinear(torch.nn.Module):
    """A linear layer over a copy of one or more projections' weights, concatenated along the
    output dimension, with each source's active LoRA delta merged in (``W + scaling * B @ A``,
    rounded once to the model's dtype). :meth:`refresh` re-reads the sources (after optimizer
    steps); the copy keeps its address, so a captured graph sees the new values."""

    def __init__(self, sources: list[Any]) -> None:
        super().__init__()
        bases = [m.get_base_layer() if _is_lora(m) else m for m in sources]
        w0 = bases[0].weight
        self.sizes = tuple(int(b.weight.shape[0]) for b in bases)
        self.sources = list(sources)  # a plain list: not submodules of this view
        self.register_buffer("weight", torch.empty(sum(self.sizes), w0.shape[1], dtype=w0.dtype, device=w0.device))
        has_bias = any(b.bias is not None for b in bases)
        self.register_buffer("bias", torch.zeros(sum(self.sizes), dtype=w0.dtype, device=w0.device) if has_bias else None)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        row = 0
        for module, n in zip(self.sources, self.sizes):
            base = module.get_base_layer() if _is_lora(module) else module
            target = self.weight[row : row + n]
            delta = None
            if _is_lora(module) and not module.disable_adapters and not module.merged:
                for name in module.active_adapters:
                    if name in module.lora_A:
                        d = module.get_delta_weight(name).float()
                        delta = d if delta is None else delta + d
            if delta is None:
                target.copy_(base.weight)
            else:
                target.copy_(base.weight.float() + delta)
            if self.bias is not None:
                if base.bias is None:
                    self.bias[row : row + n].zero_()
                else:
                    self.bias[row : row + n].copy_(base.bias)
            row += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _MergedAttention(torch.nn.Module):
    def __init__(self, attn: Any) -> None:
        super().__init__()
        self.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv_sizes = self.qkv_proj.sizes
        self.o_proj = FusedLinear([attn.o_proj])
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)


class _MergedMLP(torch.nn.Module):
    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = FusedLinear([mlp.down_proj])
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class MergedLayer(torch.nn.Module):
    """What the decode loop reads of one decoder layer, with the projections replaced by
    :class:`FusedLinear` copies (q/k/v fused, gate/up fused, LoRA merged); the norms are the
    layer's own modules."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn = _MergedAttention(layer.self_attn)
        self.mlp = _MergedMLP(layer.mlp)

    def refresh(self) -> None:
        for module in self.modules():
            if isinstance(module, FusedLinear):
                module.refresh()


_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def merged_layers_supported(parts: "DecoderParts") -> str | None:
    """None if every layer can be decoded from merged, fused copies; else the reason why not."""
    for layer in parts.layers:
        for owner_name, names in _PROJECTIONS:
            owner = getattr(layer, owner_name, None)
            for name in names:
                module = getattr(owner, name, None)
                if module is None or not _mergeable(module):
                    return f"{owner_name}.{name} is not a plain or LoRA linear layer over a floating-point weight"
        if not hasattr(layer.mlp, "act_fn"):
            return "the MLP has no act_fn"
    return None


def has_lora(parts: "DecoderParts") -> bool:
    """Whether any decoder layer carries a peft LoRA layer."""
    return any(_is_lora(m) for layer in parts.layers for m in layer.modules())


# -- sampling ------------------------------------------------------------------------------------


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


def sample_tokens(
    logits: torch.Tensor, seen: torch.Tensor | None, s: SamplingSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from the processed distribution.

    Returns the tokens (B,) and their log-probabilities under the distribution actually sampled
    from (after penalty, temperature and filters), (B,) float32. Sampling is the Gumbel-max trick
    (``argmax(log p - log E)``, ``E ~ Exp(1)``), which needs no host sync and captures in a graph.
    """
    logp_all = process_logits(logits, seen, s).log_softmax(dim=-1)  # (B, V)
    noise = torch.empty_like(logp_all).exponential_()
    tokens = (logp_all - noise.log()).argmax(dim=-1)  # (B,)
    return tokens, logp_all.gather(1, tokens[:, None]).squeeze(1)


# -- one transformer pass ------------------------------------------------------------------------


def _embed(parts: DecoderParts, ids: torch.Tensor) -> torch.Tensor:
    # ``forward`` skips module hooks: gradient checkpointing registers one on the embedding that
    # calls requires_grad_(), which torch.compile cannot trace and generation does not need.
    return parts.embed.forward(ids)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _qkv(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: DecoderParts):
    """Projections with RoPE for hidden states ``h`` (B, Q, H) -> q (B, Hq, Q, D), k/v (B, Hkv, Q, D)."""
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
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, Q, D)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
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
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    bias: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer for one new token per row: writes its key/value at cache index
    ``index`` of ``k_all``/``v_all`` (B, Hkv, S, D) and attends over all S slots under ``bias``
    (B, 1, 1, S). ``h`` (B, 1, H) -> (B, 1, H). The same function serves every layer, so it is
    compiled once for the whole model."""
    B = h.shape[0]
    G = parts.num_heads // parts.num_kv_heads
    x = layer.input_layernorm(h)
    q, k, v = _qkv(layer, x, cos, sin, parts)  # q (B, Hq, 1, D), k/v (B, Hkv, 1, D)
    k_all.index_copy_(2, index, k)
    v_all.index_copy_(2, index, v)
    # Grouped-query attention without repeating the cache: the G query heads that share a
    # key/value head become G rows of one (G, D) x (D, S) product.
    q = q.view(B, parts.num_kv_heads, G, parts.head_dim)  # (B, Hkv, G, D)
    scores = torch.matmul(q, k_all.transpose(-1, -2)) * parts.scaling + bias  # (B, Hkv, G, S)
    probs = scores.float().softmax(dim=-1).to(v_all.dtype)
    o = torch.matmul(probs, v_all)  # (B, Hkv, G, D)
    h = h + layer.self_attn.o_proj(o.reshape(B, 1, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def decode_head(parts: DecoderParts, st: DecodeState, s: SamplingSettings, pad_id: int, stop_at_eos: bool, h: torch.Tensor) -> None:
    """The final norm, LM head and sampling of one decode step; records the token at column
    ``st.step`` and advances the counters."""
    logits = parts.lm_head(parts.norm(h))[:, 0].float()  # (B, V)
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
    layer_fn: Callable[..., torch.Tensor] = decode_layer,
    head_fn: Callable[..., None] = decode_head,
) -> None:
    """One token for every row, entirely on the device and with fixed shapes (graph-capturable):
    feed ``st.token`` at cache index ``st.cur``, sample the next token, record it at column
    ``st.step``, and advance the counters. ``layer_fn`` / ``head_fn``: :func:`decode_layer` and
    :func:`decode_head` or compiled versions of them."""
    h = _embed(parts, st.token[:, None])  # (B, 1, H)
    cos, sin = parts.rotary(h, st.position[:, None])  # (B, 1, D)
    valid = st.key_valid & (st.slots <= st.cur)  # (B, S)
    bias = torch.zeros(valid.shape, dtype=h.dtype, device=h.device).masked_fill(~valid, float("-inf"))
    bias = bias[:, None, None, :]  # (B, 1, 1, S)
    index = st.cur.view(1)
    for i, layer in enumerate(parts.layers):
        h = layer_fn(parts, layer, h, cos, sin, st.k_cache[i], st.v_cache[i], bias, index)
    head_fn(parts, st, s, pad_id, stop_at_eos, h)


# -- the runner ----------------------------------------------------------------------------------


def bucket(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return max(multiple, math.ceil(n / multiple) * multiple)


def batch_bucket(n: int) -> int:
    """The batch rows a graph is built for: the next power of two, at least 8."""
    return max(8, 1 << (max(n, 1) - 1).bit_length())


@dataclass
class _Graph:
    state: DecodeState
    replay: Callable[[], None]


def join_parts(parts: list[tuple[torch.Tensor, ...]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Stack the outputs of batches decoded one after the other (``max_batch_rows``): completion
    ids, mask, truncation flags and log-probs, right-padded to the longest completion."""
    if len(parts) == 1:
        return parts[0]
    width = max(p[0].shape[1] for p in parts)

    def widen(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return (
        torch.cat([widen(p[0], pad_id) for p in parts]),  # (n, T)
        torch.cat([widen(p[1], 0) for p in parts]),  # (n, T)
        torch.cat([p[2] for p in parts]),  # (n,)
        torch.cat([widen(p[3], 0.0) for p in parts]),  # (n, T)
    )


def return_freed_memory(device: torch.device) -> None:
    """Hand the allocator's unused blocks back to the driver (CUDA only).

    After ``release_cache`` frees the KV cache and graph pool, their blocks would otherwise stay
    reserved by torch's caching allocator, and the training pass, whose tensors have other sizes,
    reserves new blocks on top of them: at 7B x 16 x 8192 the training pass reserved 25.7 GiB for
    18.9 GiB allocated. Generation has synchronised already, so this costs little.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()


class StaticDecoder:
    """Generates with a static KV cache; keeps one decode graph per (batch, prompt) bucket.

    Args:
        model: the (possibly peft/DDP-wrapped) causal LM being trained.
        sampling: the run's sampling settings.
        eos_ids: token ids that end a completion.
        pad_id: the id written after EOS.
        compile: ``torch.compile`` the decode step (CUDA only).
        cuda_graph: capture the decode step in a CUDA graph (CUDA only).
        prompt_multiple: prompts are left-padded to a multiple of this many tokens.
        check_every: decode steps between checks whether every row has finished (one host sync).
        stop_at_eos: False keeps sampling past EOS (benchmarks that want full-length completions).
        max_graphs: graphs (with their KV caches) kept at once, least recently used dropped first.
        release_cache: drop every graph and KV cache (and merged weights) at the end of each
            ``generate``.
        max_batch_rows: decode at most this many rows at a time (None: all at once); a longer
            batch is decoded in consecutive parts, so the KV cache holds this many rows.
        compile_backend: the ``torch.compile`` backend (``aot_eager`` in CPU tests).
        merge_weights: decode from :class:`MergedLayer` copies of the projection weights (LoRA
            deltas merged, q/k/v and gate/up fused), refreshed before each ``generate``; costs one
            copy of those weights. None (auto): on for a LoRA model whose layers allow it, where
            the adapters' separate small products (float32 under peft) otherwise dominate a
            decode step.
    """

    def __init__(
        self,
        model: Any,
        sampling: SamplingSettings,
        eos_ids: list[int],
        pad_id: int,
        *,
        compile: bool = True,
        cuda_graph: bool = True,
        prompt_multiple: int = 64,
        check_every: int = 16,
        stop_at_eos: bool = True,
        max_graphs: int = 2,
        release_cache: bool = False,
        compile_backend: str = "inductor",
        merge_weights: bool | None = None,
        max_batch_rows: int | None = None,
    ) -> None:
        self.model = model
        self.max_batch_rows = max_batch_rows
        self.parts = check_supported(model)
        self.sampling = sampling
        self.eos_ids = sorted(set(eos_ids))
        self.pad_id = pad_id
        self.compile = compile
        self.cuda_graph = cuda_graph
        self.prompt_multiple = prompt_multiple
        self.check_every = max(1, check_every)
        self.stop_at_eos = stop_at_eos and bool(self.eos_ids)
        self.max_graphs = max_graphs
        self.release_cache = release_cache
        self.compile_backend = compile_backend
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._weights_key: tuple[int, ...] = ()
        self._compiled_step: Callable[..., None] | None = None
        self._merged: list[MergedLayer] | None = None
        reason = merged_layers_supported(self.parts)
        if merge_weights is None:
            merge_weights = reason is None and has_lora(self.parts)
        elif merge_weights and reason is not None:
            raise UnsupportedModelError(f"generator 'static': merge_weights needs mergeable layers, but {reason}")
        self.merge_weights = merge_weights

    # -- graphs ---------------------------------------------------------------------------------

    def _param_key(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _step_fn(self) -> Callable[..., None]:
        if self._compiled_step is None:
            fn: Callable[..., None] = decode_step
            if self.compile:
                # Regional compilation: one graph for a layer (shared by every layer) and one for
                # the head and sampling, with batch rows and cache length symbolic. Compiling the
                # whole unrolled step instead took minutes on a 30-layer LoRA model and
                # recompiled for every new (batch, prompt) bucket; now a bucket costs only a
                # CUDA-graph capture.
                layer_fn = torch.compile(decode_layer, fullgraph=True, dynamic=True, backend=self.compile_backend)
                head_fn = torch.compile(decode_head, fullgraph=True, dynamic=True, backend=self.compile_backend)
                fn = functools.partial(decode_step, layer_fn=layer_fn, head_fn=head_fn)
            self._compiled_step = fn
        return self._compiled_step

    def _graph(self, parts: DecoderParts, B: int, P: int, T: int, device: torch.device, dtype: torch.dtype) -> _Graph:
        key = (B, P, T)
        if key in self._graphs:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            return self._graphs[key]
        while len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        st = DecodeState.allocate(
            parts, B, P + T, T, len(self.eos_ids), self.sampling.repetition_penalty != 1.0, dtype, device
        )
        st.eos.copy_(torch.tensor(self.eos_ids, dtype=torch.long))
        step = self._step_fn()
        args = (parts, st, self.sampling, self.pad_id, self.stop_at_eos)
        if device.type == "cuda" and self.cuda_graph:
            # Warm up (and compile) on a side stream, then capture one step. The counters the
            # warm-up advanced are reset by every generate() before the first replay.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    st.cur.zero_()
                    st.step.zero_()
                    step(*args)
            torch.cuda.current_stream(device).wait_stream(side)
            st.cur.zero_()
            st.step.zero_()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    step(*args)
                entry = _Graph(st, graph.replay)
            except RuntimeError as exc:  # e.g. a quantised layer's kernel that cannot be captured
                logger.warning(
                    "generator 'static': capturing the decode step in a CUDA graph failed (%s); decoding "
                    "without a graph from now on", str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                self.cuda_graph = False
                entry = _Graph(st, lambda: step(*args))
        else:
            entry = _Graph(st, lambda: step(*args))
        self._graphs[key] = entry
        return entry

    def clear(self) -> None:
        """Drop every graph and cache (e.g. after the model's parameters were replaced)."""
        self._graphs.clear()

    def _decode_parts(self) -> DecoderParts:
        """The parts the decode loop reads: the model's own, or merged copies brought up to date
        with the current weights."""
        if not self.merge_weights:
            return self.parts
        if self._merged is None:
            self._merged = [MergedLayer(layer) for layer in self.parts.layers]
            extra = sum(b.numel() * b.element_size() for m in self._merged for b in m.buffers())
            logger.info(
                "generator 'static': decoding from merged, fused copies of the projection weights (%.2f GiB)",
                extra / 2**30,
            )
        else:
            for layer in self._merged:
                layer.refresh()
        return dataclasses.replace(self.parts, layers=self._merged)

    # -- generation -----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample completions for ``prompt_ids``.

        Returns ``(completion_ids, completion_mask, is_truncated, sampling_logps)`` with
        shapes (B, T'), (B, T'), (B,), (B, T'), T' = the longest completion (EOS included).
        """
        if any(len(p) == 0 for p in prompt_ids):
            raise GRPOPluginsError("generator 'static': every prompt needs at least one token")
        rows = min(self.max_batch_rows or len(prompt_ids), len(prompt_ids))
        # Every part is decoded in one graph and cache, shaped for the longest prompt of the batch
        # and the largest part, so a shorter part does not capture (and keep) a second one.
        longest = max(len(p) for p in prompt_ids)
        parts = [self._sample(prompt_ids[i : i + rows], longest, rows) for i in range(0, len(prompt_ids), rows)]
        out = join_parts(parts, self.pad_id)
        if self.release_cache:
            # Only here, once _sample has returned: its locals hold the graph, the KV cache and the
            # merged layers until then, and the allocator cannot hand back blocks still in use.
            self.clear()
            self._merged = None
            return_freed_memory(self.parts.embed.weight.device)
        return out

    def _sample(
        self, prompt_ids: list[list[int]], longest: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode ``prompt_ids`` (at most ``rows``, none longer than ``longest`` tokens) in the
        graph and cache for (rows, longest)."""
        key = self._param_key()
        if key != self._weights_key:  # parameters re-allocated: captured addresses are stale
            self.clear()
            self._weights_key = key
        device = self.parts.embed.weight.device
        dtype = self.parts.embed.weight.dtype
        n, T = len(prompt_ids), self.sampling.max_completion_length
        P = bucket(longest, self.prompt_multiple)
        B = batch_bucket(rows) if device.type == "cuda" else rows
        window = self.parts.sliding_window
        if window is not None and P + T > window:
            raise UnsupportedModelError(
                f"generator 'static': prompt + completion ({P + T} tokens) exceed the model's "
                f"sliding window ({window}); use generator: transformers"
            )
        parts = self._decode_parts()
        graph = self._graph(parts, B, P, T, device, dtype)
        st = graph.state

        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros(B, P, dtype=torch.bool)
        for row, p in enumerate(prompt_ids):
            ids[row, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[row, P - len(p) :] = True
        valid[n:, P - 1] = True  # padding rows attend to one slot, so nothing is fully masked
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, P), as generate() does

        was_training = self.model.training
        self.model.eval()  # no dropout (LoRA) while sampling
        try:
            logits = prefill(parts, ids, valid, positions, st.k_cache, st.v_cache)  # (B, V)
            st.key_valid[:, :P] = valid
            st.key_valid[:, P:] = True
            st.done.zero_()
            st.done[n:] = True
            if st.seen is not None:
                st.seen.zero_()
                st.seen.scatter_(1, ids, valid)
            token, logp = sample_tokens(logits, st.seen, self.sampling)
            token = torch.where(st.done, self.pad_id, token)
            st.out_tokens.fill_(self.pad_id)
            st.out_logps.zero_()
            st.out_tokens[:, 0] = token
            st.out_logps[:, 0] = torch.where(st.done, 0.0, logp)
            if self.stop_at_eos:
                st.done |= (token[:, None] == st.eos).any(dim=-1)
            if st.seen is not None:
                st.seen.scatter_(1, token[:, None], True)
            st.token.copy_(token)
            st.position.copy_(valid.long().sum(-1))
            st.cur.fill_(P)
            st.step.fill_(1)
            steps = 1
            while steps < T:
                if self.stop_at_eos and steps % self.check_every == 0 and bool(st.done.all()):
                    break
                graph.replay()
                steps += 1
        finally:
            self.model.train(was_training)

        tokens = st.out_tokens[:n, :steps].clone()  # (n, steps)
        logps = st.out_logps[:n, :steps].clone()
        if self.stop_at_eos:
            is_eos = (tokens[:, :, None] == st.eos).any(dim=-1)  # (n, steps)
        else:
            is_eos = torch.zeros_like(tokens, dtype=torch.bool)
        tokens, mask, truncated, _ = cut_at_eos(tokens, is_eos, self.pad_id)  # (n, T) (n, T) (n,)
        logps = logps[:, : mask.shape[1]].masked_fill(mask == 0, 0.0)
        return tokens, mask, truncated, logps
