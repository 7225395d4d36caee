"""Row chunks of a micro-batch: forward+backward a few rows at a time, same gradient.

Peak training memory is dominated by the activations of the rows in one forward+backward.
With ``train_chunk_rows`` the engine runs each micro-step as several forward+backward passes
over chunks of its rows. The gradient stays exactly the whole micro-batch's because every loss
reduction is *linear* in the per-token loss once its normalisers are fixed: the per-token loss
of a chunk is placed into a zero (B, T) tensor (rows outside the chunk are constants with no
graph) and the loss type's own ``reduce`` runs on it with the micro-batch's full mask and
advantages, so ``sum over chunks of reduce(chunk) == reduce(all rows)``. No loss type is known
by name; the wrapper works for any ``reduce`` that is a weighted sum of per-token losses with
weights that depend on the mask, advantages and settings only (every built-in one). A ``reduce``
that is nonlinear in the per-token loss, or reads the log-probs of other rows, is not exact
under chunking: rows outside the chunk show zero log-probs (ratio 1) to it.

With ``group_by_length`` the rows are first sorted by length (longest first) and each chunk is
cut to its own longest row, so a micro-step whose completion lengths vary costs in proportion to
its real tokens rather than rows x the longest completion (:func:`length_chunks`). A chunk's
per-token tensors are then narrower than the micro-batch's; ``reduce`` pads them with the values
a padded column would have had (its mask is zero there), so the sum is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.kinds import LossInputs, LossType, RowExtremum

__all__ = ["ChunkedReduction", "length_chunks", "row_chunks"]

#: What one more forward+backward costs beyond its tokens, as a share of the padded micro-batch's
#: tokens: a split must save more padding than this to be made (kernel launches, and smaller
#: matrix products run below the device's best rate).
SPLIT_COST = 0.01


def row_chunks(rows: int, chunk_rows: int | None) -> list[slice]:
    """Consecutive slices covering ``range(rows)``, each at most ``chunk_rows`` long (one slice
    for everything when ``chunk_rows`` is None or not smaller than ``rows``)."""
    if chunk_rows is None or chunk_rows >= rows:
        return [slice(0, rows)]
    return [slice(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def length_chunks(
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    chunk_rows: int | None,
    *,
    split: bool,
    min_pass_tokens: int = 0,
    max_pass_tokens: int | None = None,
) -> tuple[list[int], list[slice]]:
    """The rows' order (longest first; stable) and consecutive chunks of that order.

    A chunk's cost is its rows x (its longest prompt + its longest completion) tokens, at least
    ``min_pass_tokens`` (a pass that small is bound by the host launching its kernels, not by its
    tokens; see :func:`~grpo_plugins.policy.host_bound_tokens`), plus :data:`SPLIT_COST` of the
    whole padded micro-batch per chunk. With ``split`` the chunks are
    the cheapest partition of the sorted rows (at most ``chunk_rows`` rows and at least two
    each); without it, ``chunk_rows`` rows each (one chunk when ``chunk_rows`` is None), in the
    original order when there is a single chunk.

    ``max_pass_tokens`` caps a chunk's rows x (longest prompt + longest completion): with
    ``split``, no chunk above it unless it has too few rows to split (two or three); without,
    the rows per chunk are lowered until the longest rows fit (at least one).
    """
    B = len(prompt_lengths)
    if not split and max_pass_tokens is not None and B:
        widest = max(p + c for p, c in zip(prompt_lengths, completion_lengths))
        fitting = max(1, max_pass_tokens // max(widest, 1))
        chunk_rows = fitting if chunk_rows is None else min(chunk_rows, fitting)
    if not split and (chunk_rows is None or chunk_rows >= B):
        return list(range(B)), [slice(0, B)]
    order = sorted(range(B), key=lambda i: -(prompt_lengths[i] + completion_lengths[i]))
    if not split:
        return order, row_chunks(B, chunk_rows)
    most = B if chunk_rows is None else chunk_rows
    least = min(2, most, B)  # one row would give torch.compile a batch size it specialises on
    overhead = SPLIT_COST * B * (max(prompt_lengths, default=0) + max(completion_lengths, default=0))
    best = [0.0] + [float("inf")] * B  # best[j]: the cheapest cost of the first j sorted rows
    start = [0] * (B + 1)
    for j in range(1, B + 1):
        p = c = 0
        for i in range(j - 1, -1, -1):  # the chunk order[i:j]
            p, c = max(p, prompt_lengths[order[i]]), max(c, completion_lengths[order[i]])
            rows = j - i
            if rows > most:
                break
            # Over the cap: unless too few rows to split into two chunks of `least`, no chunk ending
            # at j that starts earlier fits either (widths only grow as i falls).
            if max_pass_tokens is not None and rows >= 2 * least and rows * (p + c) > max_pass_tokens:
                break
            if rows < least and not (i == 0 and j == B):
                continue
            cost = best[i] + max(rows * (p + c), min_pass_tokens) + overhead
            if cost < best[j]:
                best[j], start[j] = cost, i
    cuts, j = [], B
    while j > 0:
        cuts.append(slice(start[j], j))
        j = start[j]
    return order, cuts[::-1]


def _pad_columns(x: Tensor, width: int, full: int, fill: float) -> Tensor:
    """A (b, width) per-token tensor widened to (b, full) with ``fill``; others unchanged."""
    if width == full or x.dim() < 2 or x.shape[-1] != width:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], full - width), fill)], dim=-1)


def _pad_rows(x: Tensor, rows: slice, total: int, fill: float) -> Tensor:
    """``x`` (b, ...) placed at ``rows`` of a (total, ...) tensor filled with ``fill`` elsewhere."""
    before = x.new_full((rows.start, *x.shape[1:]), fill)
    after = x.new_full((total - rows.stop, *x.shape[1:]), fill)
    return torch.cat([before, x, after], dim=0)


class ChunkedReduction(LossType):
    """A loss type seen through one row chunk of a micro-batch.

    ``per_token_loss`` and ``metrics`` are the wrapped loss type's on the chunk's rows (metrics
    merge exactly with :meth:`LossMetrics.merge`); ``reduce`` returns the chunk's share of the
    whole micro-batch's loss, with every normaliser computed on the whole micro-batch.

    Args:
        loss_type: the built loss type to wrap.
        mask: (B, T) float completion mask of the whole micro-batch.
        advantages: (B,) or (B, T) advantages of the whole micro-batch.
        rows: the chunk's rows within the micro-batch.

    The chunk's tensors may hold fewer than T columns (a chunk cut to its own longest row, at
    least two columns when T is); ``reduce`` widens them first.
    """

    def __init__(self, loss_type: Any, mask: Tensor, advantages: Tensor, rows: slice) -> None:
        self.inner = loss_type
        self.full_mask = mask  # (B, T)
        self.full_advantages = advantages  # (B,) or (B, T)
        self.rows = rows
        self.applies_rollout_correction = getattr(loss_type, "applies_rollout_correction", False)

    def per_token_loss(self, inputs: LossInputs) -> Tensor:
        return self.inner.per_token_loss(inputs)

    def metrics(self, inputs: LossInputs) -> dict[str, Tensor | RowExtremum]:
        return self.inner.metrics(inputs)

    def reduce(self, per_token_loss: Tensor, inputs: LossInputs) -> Tensor:
        B, T = self.full_mask.shape
        rows = self.rows
        dtype = inputs.mask.dtype
        t = per_token_loss.shape[-1]

        def widen(x: Tensor, fill: float) -> Tensor:
            return _pad_columns(x, t, T, fill)

        advantages = self.full_advantages.to(dtype)
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
        full = dataclasses.replace(
            inputs,
            per_token_logps=_pad_rows(widen(inputs.per_token_logps.detach(), 0.0), rows, B, 0.0),  # (B, T)
            old_per_token_logps=_pad_rows(widen(inputs.old_per_token_logps, 0.0), rows, B, 0.0),  # (B, T)
            log_ratio=_pad_rows(widen(inputs.log_ratio.detach(), 0.0), rows, B, 0.0),  # (B, T)
            log_weights=_pad_rows(widen(inputs.log_weights.detach(), 0.0), rows, B, 0.0),  # (B, T) or (B, 1)
            ratio=_pad_rows(widen(inputs.ratio.detach(), 1.0), rows, B, 1.0),  # (B, T) or (B, 1)
            advantages=advantages,
            mask=self.full_mask.to(dtype),  # (B, T)
            rollout_weights=(
                None if inputs.rollout_weights is None else _pad_rows(widen(inputs.rollout_weights, 1.0), rows, B, 1.0)
            ),
        )
        return self.inner.reduce(_pad_rows(widen(per_token_loss, 0.0), rows, B, 0.0), full)  # (B, T) in
