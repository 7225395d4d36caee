"""The parts of a Llama-style decoder that the static decode loop drives (:func:`check_supported`
says why a model is not supported), and :class:`MergedLayer`: copies of a layer's projections
with LoRA merged in and q/k/v (and gate/up) fused, for decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.fp8_base import Float8Linear, quantize_rows
from grpo_plugins.generators.common import base_model
from grpo_plugins.generators.fp8_products import MAX_ROWS as FP8_KERNEL_ROWS, fp8_kernel_unsupported, fp8_rows_product
from grpo_plugins.multimodal import placeholder_token_ids

#: model_type values whose decoder layers this loop reproduces exactly.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "qwen2_vl_text", "qwen2_5_vl_text"})
"""The decoder types the static loop runs: text models, and the language models of
vision-language models (Qwen2-VL / Qwen2.5-VL; Idefics3 / SmolVLM decode with Llama)."""


class UnsupportedModelError(GRPOPluginsError):
    """The static decode loop cannot run this model (architecture or feature not supported)."""


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
    sectioned_rope: bool = False
    #: decode attention as one Triton kernel (:mod:`~grpo_plugins.generators.decode_attention`)
    fused_attention: bool = False


class SectionedRotary(torch.nn.Module):
    """A multimodal (sectioned, M-RoPE) rotary embedding given one position per token: every
    section at that position, which is what a text token's rotation is in Qwen2-VL. ``forward``
    takes (B, L) positions like a text model's rotary embedding and returns (B, L, D) cos/sin."""

    def __init__(self, rotary: Any) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, position_ids[None].expand(3, -1, -1))
        if cos.dim() == 4:  # (3, B, L, D) in versions that leave the sections to the attention
            cos, sin = cos[0], sin[0]
        return cos, sin


class SuppressedHead(torch.nn.Module):
    """An LM head whose logits for ``token_ids`` are -inf: a vision-language model's image
    placeholders, which a completion never holds (the training pass leaves them out too)."""

    def __init__(self, head: Any, token_ids: list[int]) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long, device=head.weight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).index_fill(-1, self.token_ids, float("-inf"))


def check_supported(model: Any) -> DecoderParts:
    """The decoder parts of ``model``; raises :class:`UnsupportedModelError` saying why not."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a vision-language model's language model
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"generator 'static' supports model types {sorted(SUPPORTED_MODEL_TYPES)}, not "
            f"'{model_type}'; use generator: transformers"
        )
    inner = getattr(base, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (inner is None or not all(hasattr(inner, n) for n in needed)) and hasattr(base, "get_decoder"):
        inner = base.get_decoder()  # a vision-language model: its language model
    if inner is None or not all(hasattr(inner, n) for n in needed):
        raise UnsupportedModelError(
            f"generator 'static': the {model_type} model lacks model.{{{', '.join(needed)}}}; "
            "use generator: transformers"
        )
    lm_head = base.get_output_embeddings()
    suppressed = placeholder_token_ids(base.config)
    if suppressed:
        lm_head = SuppressedHead(lm_head, suppressed)
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
    sectioned = hasattr(inner.rotary_emb, "mrope_section")
    return DecoderParts(
        embed=inner.embed_tokens,
        layers=list(inner.layers),
        norm=inner.norm,
        rotary=SectionedRotary(inner.rotary_emb) if sectioned else inner.rotary_emb,
        lm_head=lm_head,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scaling=float(getattr(first_attn, "scaling", head_dim**-0.5)),
        vocab_size=lm_head.weight.shape[0] if hasattr(lm_head, "weight") else config.vocab_size,
        sliding_window=window,
        sectioned_rope=sectioned,
    )


def _is_lora(module: Any) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def _mergeable(module: Any) -> bool:
    """Whether ``module`` is a plain or peft LoRA linear layer whose weight is an ordinary
    floating-point tensor (not quantised by bitsandbytes; a float8 base gives its dequantised
    weight) and whose LoRA delta is exactly ``get_delta_weight`` (no DoRA, no LoRA bias)."""
    base = module.get_base_layer() if _is_lora(module) else module
    weight = getattr(base, "weight", None)
    if not isinstance(base, (torch.nn.Linear, Float8Linear)) or weight is None or not weight.is_floating_point():
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
    steps); the copy keeps its address, so a captured graph sees the new values.

    ``fp8``: the copy is float8 e4m3 with one scale per output channel, and the input is
    quantised to float8 per row at each call (``torch._scaled_mm``, float32 accumulation): half
    the bytes of a 16-bit weight to read per decode step, at float8's precision (3 mantissa bits).
    Decode batches (at most 128 rows) on a GPU with Triton go through a kernel made for few rows
    (:mod:`~grpo_plugins.generators.fp8_products`); longer inputs (prefill) through ``_scaled_mm``.
    """

    def __init__(self, sources: list[Any], fp8: bool = False) -> None:
        super().__init__()
        bases = [m.get_base_layer() if _is_lora(m) else m for m in sources]
        w0 = bases[0].weight
        self.sizes = tuple(int(b.weight.shape[0]) for b in bases)
        self.sources = list(sources)  # a plain list: not submodules of this view
        self.fp8 = fp8
        self.rows_kernel = fp8 and fp8_kernel_unsupported(w0.device) is None
        shape = (sum(self.sizes), w0.shape[1])
        self.register_buffer("weight", torch.empty(shape, dtype=torch.float8_e4m3fn if fp8 else w0.dtype, device=w0.device))
        self.register_buffer("scale", torch.ones(1, shape[0], dtype=torch.float32, device=w0.device) if fp8 else None)
        has_bias = any(b.bias is not None for b in bases)
        self.register_buffer("bias", torch.zeros(sum(self.sizes), dtype=w0.dtype, device=w0.device) if has_bias else None)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        row = 0
        for module, n in zip(self.sources, self.sizes):
            base = module.get_base_layer() if _is_lora(module) else module
            delta = None
            if _is_lora(module) and not module.disable_adapters and not module.merged:
                for name in module.active_adapters:
                    if name in module.lora_A:
                        d = module.get_delta_weight(name).float()
                        delta = d if delta is None else delta + d
            if self.fp8:
                if isinstance(base, Float8Linear):  # kept on the base's own float8 grid
                    weight8, scale = base.merged_float8(delta)
                else:
                    merged = base.weight if delta is None else base.weight.float() + delta
                    # Rounded to the model's dtype first, as the 16-bit copy is: float8 then
                    # quantises exactly the weights the 16-bit decode would read.
                    weight8, scale = quantize_rows(merged.to(base.weight.dtype))
                self.weight[row : row + n].copy_(weight8)
                self.scale[0, row : row + n].copy_(scale[:, 0])
            else:
                self.weight[row : row + n].copy_(base.weight if delta is None else base.weight.float() + delta)
            if self.bias is not None:
                if base.bias is None:
                    self.bias[row : row + n].zero_()
                else:
                    self.bias[row : row + n].copy_(base.bias)
            row += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return F.linear(x, self.weight, self.bias)
        x8, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        if self.rows_kernel and x8.shape[0] <= FP8_KERNEL_ROWS:
            y = fp8_rows_product(x8, scale, self.weight, self.scale, x.dtype)
        else:
            y = torch._scaled_mm(x8, self.weight.t(), scale_a=scale, scale_b=self.scale, out_dtype=x.dtype)
        if self.bias is not None:  # not _scaled_mm's bias: some builds refuse it with row-wise scales
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class _MergedAttention(torch.nn.Module):
    def __init__(self, attn: Any, fp8: bool) -> None:
        super().__init__()
        self.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], fp8)
        self.qkv_sizes = self.qkv_proj.sizes
        self.o_proj = FusedLinear([attn.o_proj], fp8)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)


class _MergedMLP(torch.nn.Module):
    def __init__(self, mlp: Any, fp8: bool) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj], fp8)
        self.down_proj = FusedLinear([mlp.down_proj], fp8)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class MergedLayer(torch.nn.Module):
    """What the decode loop reads of one decoder layer, with the projections replaced by
    :class:`FusedLinear` copies (q/k/v fused, gate/up fused, LoRA merged; float8 with ``fp8``);
    the norms are the layer's own modules."""

    def __init__(self, layer: Any, fp8: bool = False) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn = _MergedAttention(layer.self_attn, fp8)
        self.mlp = _MergedMLP(layer.mlp, fp8)

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


#: Full fine-tuning decodes from fused copies by default when they take at most this share of the
#: GPU's memory (a LoRA model always does: its unmerged adapter products dominate a decode step).
FUSED_COPY_SHARE = 0.05


def fused_copy_bytes(parts: "DecoderParts") -> int:
    """Bytes of the 16-bit fused copies of every decoder layer's projections (weights and biases)."""
    total = 0
    for layer in parts.layers:
        for owner_name, names in _PROJECTIONS:
            for name in names:
                module = getattr(getattr(layer, owner_name), name)
                base = module.get_base_layer() if _is_lora(module) else module
                for tensor in (base.weight, base.bias):
                    if tensor is not None:
                        total += tensor.numel() * tensor.element_size()
    return total


def gpu_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes if it is a CUDA device, else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def fused_copy_is_small(parts: "DecoderParts") -> bool:
    """Whether the fused copies fit in :data:`FUSED_COPY_SHARE` of the memory of the GPU holding
    the model (False off a GPU: the copies pay where the decode step is compiled)."""
    memory = gpu_memory(parts.embed.weight.device)
    return memory is not None and fused_copy_bytes(parts) <= FUSED_COPY_SHARE * memory


def has_lora(parts: "DecoderParts") -> bool:
    """Whether any decoder layer carries a peft LoRA layer."""
    return any(_is_lora(m) for layer in parts.layers for m in layer.modules())
