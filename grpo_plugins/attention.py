"""Which attention kernels the training and log-prob passes may use.

PyTorch 2.11 on H100/H200 picks cuDNN's fused attention for ``scaled_dot_product_attention``
with a mask, and its backward returns NaN in the query gradient when the sequence length is
64 modulo 128 and some query row attends to nothing (log-sum-exp of -inf), which is every
left-padding row of a padded batch (pytorch/pytorch#196678). The forward and the loss stay
finite; the NaN appears in the LoRA/weight gradients of the top layer and spreads down. It hit
the GPU example at a 192-column micro-batch: compiled layers pad lengths to a multiple of 8, so
such lengths come up often (bench/RESULTS.md, "GPU numerics checks"). The training and
log-prob passes therefore run with cuDNN attention switched off (flash, memory-efficient and
math stay on); generation is forward-only and is not affected. Text rows usually run without a
mask at all (:func:`~grpo_plugins.logprobs.left_aligned`), which selects the flash kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo_plugins.compiled_layers import CompiledLayers, layers_active

__all__ = ["TRAINING_SDPA_BACKENDS", "training_attention", "training_passes"]

#: The ``scaled_dot_product_attention`` backends allowed in the training and log-prob passes.
TRAINING_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


@contextlib.contextmanager
def training_attention() -> Iterator[None]:
    """Attention inside the block avoids cuDNN's fused kernel (see the module docstring)."""
    with sdpa_kernel(list(TRAINING_SDPA_BACKENDS)):
        yield


@contextlib.contextmanager
def training_passes(compiled: CompiledLayers | None) -> Iterator[None]:
    """The context of every training and log-prob forward (and its backward, where activation
    checkpointing recomputes the layers): the compiled layers, if any, and the safe attention
    kernels."""
    with training_attention(), layers_active(compiled):
        yield
