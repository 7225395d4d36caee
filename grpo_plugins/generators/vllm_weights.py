"""The policy's weights as a vLLM engine takes them: lazily, in the base model's names, with
LoRA deltas added out of place; and a checkpoint folder an engine can start from."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

def _policy_entries(model: Any) -> Iterator[tuple[str, Tensor, Any]]:
    """(state-dict name, tensor, LoRA layer whose delta is still to be added, or None) of
    ``model``; peft's adapter tensors are skipped."""
    if not hasattr(model, "get_base_model"):
        for name, tensor in model.state_dict().items():
            yield name, tensor, None
        return
    base = model.get_base_model()
    lora_layers = {
        f"{module_name}.base_layer.weight": module
        for module_name, module in base.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        layer = lora_layers.get(name)
        if layer is not None and (getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False)):
            layer = None
        yield name, tensor, layer


def policy_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of ``model`` in transformers naming, produced lazily.

    For a peft model each LoRA-wrapped weight is yielded as ``base + delta`` computed out of
    place (the model is never merged and unmerged, which would drift low-precision base weights
    a little at every sync); adapter tensors are skipped and ``base_layer`` /
    ``modules_to_save`` names mapped back to the base model's.
    """
    import torch

    for name, tensor, layer in _policy_entries(model):
        if layer is not None:
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}):
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        yield _base_name(name), tensor.detach()


def policy_weight_metadata(model: Any) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of each pair :func:`policy_weights` yields, in its order,
    without computing anything (a merged LoRA weight has its base weight's dtype and shape)."""
    return [
        (_base_name(name), str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        for name, tensor, _ in _policy_entries(model)
    ]


def _base_name(name: str) -> str:
    """The base model's name of a peft-wrapped state-dict entry."""
    return name.replace(".base_layer", "").replace(".modules_to_save.default", "")


def tied_names(model: Any) -> set[str]:
    """State-dict names whose tensor is one seen earlier under another name (tied weights such
    as lm_head = embed_tokens). Read from the model's own tensors, whose addresses are stable."""
    first: set[tuple[int, int, tuple[int, ...]]] = set()
    tied: set[str] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            tied.add(_base_name(name))
        first.add(key)
    return tied


def write_engine_checkpoint(policy: Any, tokenizer: Any, directory: str) -> None:
    """Write the policy as a checkpoint vLLM can start from: ``model.safetensors`` with the
    names :func:`policy_weights` yields (tied weights once), the base model's config (with its
    ``architectures``) and generation config, and the tokenizer. The tensors are gathered in
    CPU memory (one copy of the model) before the file is written."""
    from safetensors.torch import save_file

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    tied = tied_names(base)  # safetensors refuses tensors that share storage
    tensors = {name: tensor.to("cpu").contiguous() for name, tensor in policy_weights(policy) if name not in tied}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(base.config)
    # vLLM picks its model class by `architectures`, which a model built with from_config lacks.
    config.architectures = getattr(config, "architectures", None) or [type(base).__name__]
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
