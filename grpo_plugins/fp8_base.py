"""Float8 base weights for LoRA (``load_in_fp8``): the frozen linear layers multiply in float8.

Every frozen linear layer of a LoRA model except the LM head (peft's base layers, and any
linear layer LoRA leaves out) becomes a :class:`Float8Linear`: its weight as float8 e4m3 with
one float32 scale per output channel, and each call's input quantised to float8 per row
(``torch._scaled_mm``, float32 accumulation). The backward pass multiplies the output gradient,
quantised the same way, by a second, transposed float8 copy (float8 products take both operands
with the reduced dimension contiguous), so the two copies hold as many bytes as the 16-bit weight
did. On GPUs with float8 tensor cores (Ada, Hopper) those products run at up to twice the bf16
rate; the LoRA adapters, embeddings, norms and the LM head stay in their own dtypes.

What follows from it:

- The trained policy is the float8 model: its log-probs, the loss, the reference model (the base
  with the adapter off) all compute through the float8 products.
- The ``static`` generator's merged decode copies start from these float8 weights with the LoRA
  deltas added (:meth:`Float8Linear.merged_float8`: on the same grid, rounded stochastically, so
  that updates smaller than the grid's spacing are not rounded away), so they sample from a close
  neighbour of the policy: the generator says so and the rollout correction turns on under
  "auto". Without merged copies it decodes through these layers and samples the policy itself.
- Export merges the adapter into the original 16-bit base (as QLoRA exports do).
- Quantising is deterministic: a resumed run rebuilds the same float8 weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from grpo_plugins.errors import ModelLoadError
from grpo_plugins.fp8_rounding import FP8_MAX, merge_rows, round_stochastically

logger = logging.getLogger(__name__)

__all__ = [
    "FP8_MAX",
    "Float8Linear",
    "float8_base",
    "float8_layer_count",
    "float8_unsupported",
    "has_float8_base",
    "quantize_rows",
    "round_stochastically",
    "use_float8_base",
]

#: Linear layers that stay as they are: the LM head (its logits feed the log-softmax).
SKIP_MODULES = ("lm_head",)


def float8_unsupported(device: torch.device) -> str | None:
    """None if float8 matrix products (``torch._scaled_mm`` with row-wise scales) run on
    ``device``; else why not."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 matrix product"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} has no float8 tensor cores (Ada or Hopper, compute capability 8.9+, needed)"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) as float8 e4m3 with one float32 scale per row: ``(x8, scale)``, ``x ~= x8 * scale``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (M, 1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


class _Float8Product(torch.autograd.Function):
    """``x @ W^T`` (+ bias) in float8 both ways; no gradient for the frozen weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w8: torch.Tensor, w8_t: torch.Tensor, scale: torch.Tensor, ones: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_scale = quantize_rows(rows)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(w8_t, scale, ones)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        w8_t, scale, ones = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        # dX = dY @ (W8 * scale) = (dY * scale) @ W8: the weight's scale moves onto the gradient's columns.
        g8, g_scale = quantize_rows(rows.float() * scale)
        dx = torch._scaled_mm(g8, w8_t.t(), scale_a=g_scale, scale_b=ones, out_dtype=grad.dtype)
        return dx.reshape(*grad.shape[:-1], dx.shape[-1]), None, None, None, None, None


class Float8Linear(torch.nn.Module):
    """A frozen linear layer computing in float8 (see the module docstring). ``weight`` is the
    dequantised weight in the original dtype, made on each access (for merging, not for speed)."""

    def __init__(self, linear: torch.nn.Linear, noise_seed: int = 0) -> None:
        super().__init__()
        self.noise_seed = noise_seed
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = weight.dtype
        w8, scale = quantize_rows(weight)
        # The float8 bits are held as uint8: collectives (DDP's buffer broadcast under gloo)
        # refuse float8 tensors, and every process builds the same weights anyway.
        self.register_buffer("weight8", w8.view(torch.uint8))  # (N, K)
        self.register_buffer("weight8_t", w8.t().contiguous().view(torch.uint8))  # (K, N), for the backward product
        self.register_buffer("scale", scale.reshape(1, -1))  # (1, N)
        self.register_buffer("ones", torch.ones(1, self.in_features, dtype=torch.float32, device=weight.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        return (self.weight8.view(torch.float8_e4m3fn).float() * self.scale.t()).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        w8, w8_t = self.weight8.view(torch.float8_e4m3fn), self.weight8_t.view(torch.float8_e4m3fn)
        return _Float8Product.apply(x, w8, w8_t, self.scale, self.ones, bias)

    @torch.no_grad()
    def merged_float8(self, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float8 weights and per-row scales for this weight plus ``delta`` (N, K), e.g. a LoRA
        update: ``(w8, scale)``, ``w8 * scale ~= W + delta``.

        Each row keeps its scale (its grid) unless the update outgrows it, and values are rounded
        to a neighbouring grid point at random, with the probabilities that make the expected
        result exact (:func:`grpo_plugins.fp8_rounding.merge_rows`). Rounding to the nearest
        point instead would return the base weights unchanged for every update below half a grid
        step: a sampler built that way lags ever further behind the policy it is meant to follow.
        The random numbers are the same at every call (``noise_seed``), so a run and its
        resumption build the same weights."""
        return merge_rows(self.weight8.view(torch.float8_e4m3fn), self.scale[0], delta, self.noise_seed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, float8 e4m3"


def float8_base(model: Any) -> int:
    """Replace every frozen ``torch.nn.Linear`` of ``model`` (a peft LoRA model: its base layers
    and any linear layer without an adapter) except the LM head, whose sizes are multiples of 16,
    by a :class:`Float8Linear` on the same device; returns how many were replaced. Layers already
    replaced are kept."""
    targets = [
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and not module.weight.requires_grad
        and name.rsplit(".", 1)[-1] not in SKIP_MODULES
        and ".lora_" not in f".{name}"
        # Float8 products take sizes that are multiples of 16 (cuBLASLt); other layers stay 16-bit.
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ]
    for index, name in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear(getattr(parent, child), noise_seed=index))
    logger.info("load_in_fp8: %d linear layers multiply in float8", len(targets))
    return len(targets)


def float8_layer_count(model: Any) -> int:
    """How many :class:`Float8Linear` layers ``model`` holds."""
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def has_float8_base(model: Any) -> bool:
    """Whether ``model`` (peft/DDP-wrapped or not) holds float8 base layers."""
    return any(isinstance(m, Float8Linear) for m in model.modules())


def use_float8_base(model: Any) -> None:
    """``load_in_fp8``: the frozen linear layers of a LoRA ``model`` multiply in float8
    (:func:`grpo_plugins.fp8_base.float8_base`), unless they do already."""
    from grpo_plugins.vision_models import is_vision_model

    if has_float8_base(model):
        return
    if not hasattr(model, "peft_config"):
        raise ModelLoadError("load_in_fp8 quantises the frozen base of a LoRA model; add lora: {r: 16} or drop load_in_fp8")
    if is_vision_model(model):
        raise ModelLoadError("load_in_fp8 is for text models (a vision-language model's base stays 16-bit); drop load_in_fp8")
    weight = model.get_input_embeddings().weight
    problem = float8_unsupported(weight.device)
    if problem is not None:
        raise ModelLoadError(f"load_in_fp8 cannot run here: {problem}; drop load_in_fp8")
    if weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
        # cuBLASLt's float8 products with row-wise scales write bfloat16 only.
        raise ModelLoadError(f"load_in_fp8 on a GPU needs dtype: bfloat16 (the model is {str(weight.dtype).removeprefix('torch.')})")
    if float8_base(model) == 0:
        raise ModelLoadError("load_in_fp8: the model has no frozen linear layers to put in float8")
