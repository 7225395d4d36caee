"""Activation offload: the inputs of checkpointed layers kept in CPU memory (``activation_offload``).

With gradient checkpointing each decoder layer keeps only its input hidden states for the
backward pass, which recomputes the layer from them. Those inputs still add up to
``layers x rows x tokens x hidden x 2`` bytes on the device (1.6 GiB per 8192-token row of a
7B model). :class:`OffloadActivations` moves them to pinned CPU memory as the forward pass saves
them and back to the device when the backward pass recomputes the layer, as Unsloth's "offloaded
gradient checkpointing" does.

It works on torch's non-reentrant checkpoint: the checkpoint saves its inputs through autograd's
saved-tensor hooks (outside its own recomputation hooks), so a ``saved_tensors_hooks`` context
around the checkpoint call sees exactly the layer's inputs. Only tensors that require grad are
moved (the hidden states); the shared constants every layer also receives (attention mask,
rotary tables) stay where they are, so they are not copied once per layer. Both copies are
issued on the current stream, so they are ordered with the kernels around them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["OffloadActivations", "offload_checkpointed_inputs"]


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Inside this context, tensors that autograd saves and that require grad are held in CPU
    memory (pinned when CUDA is available) and copied back to their device when unpacked."""

    #: Tensors moved to the CPU so far (all instances; tests read it).
    packed = 0

    def __init__(self) -> None:
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def _pack(tensor: Tensor) -> Any:
        if not tensor.requires_grad or tensor.is_sparse:
            return tensor
        pin = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        OffloadActivations.packed += 1
        return (tensor.device, host)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())


def _offloading(checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(checkpoint_fn)
    def checkpoint_offloaded(*args: Any, **kwargs: Any) -> Any:
        with OffloadActivations():
            return checkpoint_fn(*args, **kwargs)

    checkpoint_offloaded.grpo_offloaded = True  # type: ignore[attr-defined]
    return checkpoint_offloaded


def offload_checkpointed_inputs(model: Any) -> int:
    """Make every checkpointed module of a transformers ``model`` (gradient checkpointing
    already enabled) offload its saved inputs; returns how many modules it changed."""
    changed = 0
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if fn is None or not getattr(module, "gradient_checkpointing", False):
            continue
        if not getattr(fn, "grpo_offloaded", False):
            module._gradient_checkpointing_func = _offloading(fn)
        changed += 1
    return changed
