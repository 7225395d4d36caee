"""The built-in importance-sampling levels: one ratio per token, or one per sequence (GSPO)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_plugins.kinds import ImportanceSampling

if TYPE_CHECKING:
    from torch import Tensor


class TokenLevel(ImportanceSampling):
    """w_t = log π(y_t) - log π_old(y_t): a ratio per token (PPO, GRPO)."""

    def log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return log_ratio  # (B, T)


class SequenceLevel(ImportanceSampling):
    """w = mean over the sequence's tokens of the log-ratios: a ratio per sequence (GSPO)."""

    def log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
