"""Quantised base weights for LoRA (QLoRA): ``load_in_4bit`` / ``load_in_8bit`` with bitsandbytes.

The frozen base model's linear layers (all but the LM head) are replaced by bitsandbytes'
``Linear4bit`` (NF4, double quantisation, computing in the run's dtype) or ``Linear8bitLt``
(LLM.int8). Embeddings, norms and the LM head stay in the run's dtype, and the LoRA adapters
peft puts on top stay float32. The same function quantises every kind of model the engine gets:
one loaded from a checkpoint, one built from a config (random initialisation) and one passed to
``Engine(model=...)``. Each layer is moved to the device and quantised there one at a time, so a
16-bit copy of the whole model never sits on the device.

What follows from a quantised base (the rest of the engine needs nothing else):

- the reference model (``beta > 0``) is the base with the adapter disabled, as for any LoRA run;
- the ``static`` generator decodes eagerly through bitsandbytes' own layers (they dequantise per
  layer, per step) unless its ``compile`` / ``cuda_graph`` params are set explicitly;
- peft's ``prepare_model_for_kbit_training`` is applied in part: the base is frozen and, with
  gradient checkpointing, the embedding output requires grad. Its cast of every 16-bit norm and
  embedding to float32 is *not* applied: it would add 4 bytes per embedding parameter (2.2 GiB at
  7B) for a precision Unsloth does not use either;
- export: merging an adapter into 4-bit weights re-quantises them (lossy). Merge into the
  original 16-bit base instead: load ``model`` unquantised, load the adapter, merge. A
  checkpoint's ``config.yaml`` records ``load_in_4bit`` / ``load_in_8bit`` for that.

bitsandbytes is an optional dependency: ``pip install 'grpo-plugins[qlora]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any

from grpo_plugins.errors import GRPOPluginsError

logger = logging.getLogger(__name__)

__all__ = [
    "QuantizationError",
    "bitsandbytes_problem",
    "is_quantized",
    "quantize_model",
    "quantized_layer_count",
]

#: Modules never quantised: the LM head (its logits feed the log-softmax; Unsloth and
#: transformers' own bitsandbytes loader keep it in 16 bits too).
SKIP_MODULES = ("lm_head",)


class QuantizationError(GRPOPluginsError):
    """The base model cannot be quantised as the config asks (bitsandbytes missing, or the
    device not supported)."""


def _setting(bits: int) -> str:
    return f"load_in_{bits}bit"


def bitsandbytes_problem(bits: int) -> str | None:
    """Why ``load_in_{bits}bit`` cannot work here, found without importing anything heavy
    (for ``validate``); None when bitsandbytes is installed."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return (
            f"{_setting(bits)} needs bitsandbytes, which is not installed: "
            "pip install 'grpo-plugins[qlora]' (or pip install bitsandbytes)"
        )
    return None


def _import_bitsandbytes(bits: int) -> Any:
    problem = bitsandbytes_problem(bits)
    if problem is not None:
        raise QuantizationError(problem)
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # a broken install: missing native library, wrong CUDA
        raise QuantizationError(f"{_setting(bits)}: bitsandbytes is installed but cannot be imported: {exc}") from exc
    return bnb


def is_quantized(model: Any) -> bool:
    """Whether ``model`` (peft/DDP-wrapped or not) holds bitsandbytes-quantised layers."""
    return quantized_layer_count(model) > 0


def quantized_layer_count(model: Any) -> int:
    """How many bitsandbytes 4-bit / 8-bit linear layers ``model`` holds."""
    if "bitsandbytes" not in sys.modules:
        return 0  # no bitsandbytes layer can exist yet (and importing it costs seconds)
    import bitsandbytes as bnb

    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return sum(isinstance(m, kinds) for m in model.modules())


def _replacement(linear: Any, bits: int, compute_dtype: Any, device: Any, bnb: Any) -> Any:
    """A bitsandbytes layer holding ``linear``'s weights, quantised on ``device``."""
    import torch

    weight = linear.weight.detach()
    bias = linear.bias.detach() if linear.bias is not None else None
    if bits == 4:
        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=bias is not None, compute_dtype=compute_dtype,
            compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8, device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            weight.to(compute_dtype), requires_grad=False, compress_statistics=True, quant_type="nf4",
            quant_storage=torch.uint8, module=layer,
        )
        # On CPUs, bitsandbytes (0.50) repacks a 4-bit weight for its inference kernel the first
        # time the layer runs in eval mode, in place and for good (and fails for layers narrower
        # than a block); a run alternates generation (eval) and training, so keep one layout.
        layer.support_avx512bf16_for_cpu = False
    else:
        layer = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=bias is not None, has_fp16_weights=False,
            threshold=6.0, device="meta",
        )
        layer.weight = bnb.nn.Int8Params(weight.to(compute_dtype), requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.to(compute_dtype), requires_grad=False)
    return layer.to(device)  # quantises the weight on the device


def quantize_model(model: Any, bits: int, compute_dtype: Any, device: Any) -> Any:
    """Replace ``model``'s linear layers (except the LM head) by bitsandbytes ``bits``-bit layers
    on ``device``, move the rest of the model there, and freeze every parameter.

    Args:
        model: a transformers causal LM, not yet peft-wrapped (its weights anywhere).
        bits: 4 (NF4, double quantisation) or 8 (LLM.int8).
        compute_dtype: the dtype the dequantised weights compute in (the run's dtype).
        device: where the model trains.

    Returns:
        ``model``, changed in place, flagged ``is_loaded_in_4bit`` / ``is_loaded_in_8bit`` as
        transformers' own loader does (peft reads the flag to wrap the layers with its
        bitsandbytes LoRA layers).

    Raises:
        QuantizationError: bitsandbytes missing or not able to run on ``device``.
    """
    import torch

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    bnb = _import_bitsandbytes(bits)
    device = torch.device(device)
    if is_quantized(model):
        logger.info("%s: the model is quantised already; kept as it is", _setting(bits))
        return model
    # Names only: holding the modules would keep every 16-bit weight alive until the end.
    targets = [
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and name.rsplit(".", 1)[-1] not in SKIP_MODULES
    ]
    if not targets:
        raise QuantizationError(f"{_setting(bits)}: the model has no linear layers to quantise")
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        try:
            setattr(parent, child, _replacement(getattr(parent, child), bits, compute_dtype, device, bnb))
        except (RuntimeError, NotImplementedError, ValueError, AttributeError) as exc:
            where = "a CPU" if device.type == "cpu" else f"device {device}"
            raise QuantizationError(
                f"{_setting(bits)}: bitsandbytes cannot quantise on {where} here ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); train on a CUDA GPU, or drop {_setting(bits)}"
            ) from exc
    model.to(device)
    model.requires_grad_(False)
    setattr(model, f"is_loaded_in_{bits}bit", True)
    logger.info("%s: quantised %d linear layers with bitsandbytes on %s", _setting(bits), len(targets), device)
    return model
