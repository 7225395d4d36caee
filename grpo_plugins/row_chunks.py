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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.kinds import LossInputs, LossType, RowExtremum

__all__ = ["ChunkedReduction", "row_chunks"]


def row_chunks(rows: int, chunk_rows: int | None) -> list[slice]:
    """Consecutive slices covering ``range(rows)``, each at most ``chunk_rows`` long (one slice
    for everything when ``chunk_rows`` is None or not smaller than ``rows``)."""
    if chunk_rows is None or chunk_rows >= rows:
        return [slice(0, rows)]
    return [slice(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


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
        B = self.full_mask.shape[0]
        rows = self.rows
        dtype = inputs.mask.dtype
        advantages = self.full_advantages.to(dtype)
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
        full = dataclasses.replace(
            inputs,
            per_token_logps=_pad_rows(inputs.per_token_logps.detach(), rows, B, 0.0),  # (B, T)
            old_per_token_logps=_pad_rows(inputs.old_per_token_logps, rows, B, 0.0),  # (B, T)
            log_ratio=_pad_rows(inputs.log_ratio.detach(), rows, B, 0.0),  # (B, T)
            log_weights=_pad_rows(inputs.log_weights.detach(), rows, B, 0.0),  # (B, T) or (B, 1)
            ratio=_pad_rows(inputs.ratio.detach(), rows, B, 1.0),  # (B, T) or (B, 1)
            advantages=advantages,
            mask=self.full_mask.to(dtype),  # (B, T)
            rollout_weights=None if inputs.rollout_weights is None else _pad_rows(inputs.rollout_weights, rows, B, 1.0),
        )
        return self.inner.reduce(_pad_rows(per_token_loss, rows, B, 0.0), full)  # (B, T) in
