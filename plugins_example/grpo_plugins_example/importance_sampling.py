"""GSPO-token (Zheng et al., 2025, "Group Sequence Policy Optimization", section 4.3) as an
importance-sampling strategy.

Every token's weight has the *value* of its sequence's GSPO ratio (the geometric mean of the
token ratios) but the *gradient* of its own token: ``s_it = sg[s_i] * p_t / sg[p_t]``. With one
advantage per sequence it gives the same gradient as sequence-level GSPO; it exists so that
per-token advantages can be used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_plugins import hookimpl

if TYPE_CHECKING:  # torch is not imported at registration time
    from torch import Tensor


class GSPOToken:
    """GSPO-token: the sequence-level ratio as each token's value, the token's own gradient."""

    def log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        sequence = (log_ratio * mask).sum(dim=-1, keepdim=True) / lengths  # (B, 1)
        return sequence.detach() + log_ratio - log_ratio.detach()  # (B, T)


@hookimpl
def register_importance_sampling_levels(register: Any) -> None:
    register(GSPOToken, name="gspo_token")
