"""``train_pass_tokens: auto``: the tokens a training pass may hold, from the device memory left.

Without gradient checkpointing a forward keeps every decoder layer's activations for the
backward, about ``4 x intermediate + 2 x hidden + q/k/v width`` values per token and layer with
compiled layers (on an H100 the peak grew by 0.98 MB per added token of a pass at
Qwen2.5-0.5B and 2.08 MB at 1.5B, bench/RESULTS.md; this estimate is 9-11 % above both), and
more in eager layers (their RMSNorms keep float32 copies). With checkpointing only each
layer's input stays (none with activation offload), plus one layer's activations while it is
recomputed. A micro-batch whose pass would not fit is split into passes that do (the gradient
is the same), instead of running out of memory.

The budget is set once, at the first pass plan of the run (after the first generation, so the
generator's cache is counted), from ``torch.cuda.mem_get_info`` plus the allocator's cached
free blocks, less what the first optimizer step will still allocate (moments and gradients)
and a tenth of the device for everything else. Each process sizes its own (their pass counts
may differ, as length grouping's already do: DDP syncs once, on a window's last pass). Off
CUDA: no budget.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Bytes per trainable parameter the first optimizer step may still allocate: two float32
#: AdamW moments and a float32 gradient.
PENDING_BYTES_PER_PARAMETER = 12
#: The share of the device's memory left for everything the estimate does not count
#: (the log-prob chunks, allocator fragmentation, workspaces).
HEADROOM = 0.10


def activation_bytes_per_token(
    model: Any, *, checkpointing: bool, offload: bool = False, compiled: bool = True
) -> int | None:
    """Bytes a training pass keeps per token for the backward, or None where the model's
    config does not give its sizes."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    hidden = getattr(cfg, "hidden_size", None)
    inter = getattr(cfg, "intermediate_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not (hidden and inter and layers):
        return None
    heads = getattr(cfg, "num_attention_heads", None) or 1
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    qkv = (heads + 2 * kv_heads) * head_dim
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    size = torch.finfo(dtype).bits // 8
    per_layer = 4 * inter + 2 * hidden + qkv if compiled else 5 * inter + 8 * hidden + 2 * qkv
    if checkpointing:
        kept = 0 if offload else layers * hidden
        return (kept + per_layer + 4 * hidden) * size
    return (layers * per_layer + 4 * hidden) * size


def pending_optimizer_bytes(parameters: Iterable[torch.Tensor], optimizer: Any) -> int:
    """What the first optimizer step will still allocate: nothing once the optimizer has state."""
    if optimizer is not None and len(getattr(optimizer, "state", {}) or {}) > 0:
        return 0
    return sum(p.numel() for p in parameters if p.grad is None) * PENDING_BYTES_PER_PARAMETER


@dataclass
class PassBudget:
    """``train_pass_tokens: auto`` for one run: :meth:`tokens` sizes the budget on first use
    and returns the same number from then on (the log-prob and training passes of a step must
    be planned alike)."""

    model: Any
    trainable: list[torch.Tensor]
    optimizer: Any
    device: torch.device
    checkpointing: bool
    offload: bool = False
    compiled: bool = True
    _tokens: int | None = field(default=None, init=False)
    _sized: bool = field(default=False, init=False)

    def tokens(self) -> int | None:
        """The most tokens (rows x padded length) a pass may hold; None: no limit."""
        if not self._sized:
            self._tokens = self._size()
            self._sized = True
        return self._tokens

    def _size(self) -> int | None:
        if self.device.type != "cuda":
            return None
        per_token = activation_bytes_per_token(
            self.model, checkpointing=self.checkpointing, offload=self.offload, compiled=self.compiled
        )
        if per_token is None:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        pending = pending_optimizer_bytes(self.trainable, self.optimizer)
        budget = free + cached - pending - int(HEADROOM * total)
        tokens = max(2, budget // per_token)
        logger.info(
            "train_pass_tokens auto: at most %d tokens per training pass (%.1f GiB for activations at "
            "~%.0f KiB per token; %.1f GiB kept for the first optimizer step)",
            tokens, max(budget, 0) / 2**30, per_token / 2**10, pending / 2**30,
        )
        return tokens
