"""The model being trained as the rollout and the micro-steps see it (:class:`Policy`), and the
padding both trim off before a forward (:func:`trim_padding`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Policy:
    """The model being trained, as the rollout and the micro-steps see it.

    Attributes:
        model: the accelerate-prepared model (DDP-wrapped on several processes).
        unwrapped: the same model without wrappers.
        ref_model: a frozen copy for the KL term (full fine-tuning with ``beta != 0``), else None.
        is_peft: a peft model: with ``beta != 0`` its reference is the adapter disabled.
        layers: a context manager factory under which forwards run (compiled layers, if any).
        chunk_fn: the compiled log-softmax chunk, or None.
        multiple: sequences are left-padded to a multiple of this (8 with compiled layers; see
            :func:`trim_padding`).
    """

    model: Any
    unwrapped: Any
    ref_model: Any
    is_peft: bool
    layers: Callable[[], AbstractContextManager[None]]
    chunk_fn: Callable[..., Any] | None
    multiple: int = 1


def trim_padding(
    input_ids: Tensor, attention_mask: Tensor, T: int, multiple: int = 1, min_t: int = 1
) -> tuple[Tensor, Tensor, int]:
    """Drop prompt columns that are padding in every row and completion columns past the longest
    completion; returns (ids, mask, kept completion length t >= min_t).

    ``multiple``: keep (or add) left padding so the length is a multiple of it. Compiled layers
    use 8: SDPA's fused kernels need the mask's rows 16-byte aligned, and torch.compile guards on
    that divisibility, so lengths that break it would compile a second graph."""
    P = input_ids.shape[1] - T
    comp = attention_mask[:, P:]  # (B, T)
    t = min(T, max(min_t, int(comp.sum(1).max()) if comp.numel() else 1))
    prompt_any = attention_mask[:, :P].any(0)  # (P,)
    first = int(prompt_any.float().argmax()) if bool(prompt_any.any()) else P
    first = min(first, max(P - 1, 0))
    end = P + t
    extra = -(end - first) % multiple
    reuse = min(extra, first)  # padding columns that are already there
    ids, mask = input_ids[:, first - reuse : end], attention_mask[:, first - reuse : end]
    if extra > reuse:
        pad = extra - reuse
        ids = torch.cat([ids.new_zeros(ids.shape[0], pad), ids], dim=1)
        mask = torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)
    return ids, mask, t
