"""What an evaluation measured: per-reward means, greedy scores and pass@k (:class:`EvalResult`),
computed from scored completions by :func:`summarise`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EvalResult", "RewardSummary", "pass_at_k", "summarise"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator ``1 - C(n-c, k) / C(n, k)``: the chance that at least one of
    ``k`` samples drawn without replacement from ``n`` samples, ``c`` of them correct, is correct
    (Chen et al. 2021). Exact integer binomials, so it is exact for any n.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class RewardSummary:
    """One reward's evaluation.

    Attributes:
        name: the reward's name (as in ``rewards/<name>/mean`` of training).
        weight: its weight in the weighted reward.
        mean: mean score over the sampled completions it scored (None: it scored none).
        greedy: mean score of the greedy completions (greedy accuracy for a 0/1 reward).
        binary: every score it gave was 0 or 1 (then ``pass_at`` is filled).
        pass_at: k -> pass@k, averaged over the prompts with at least k scored samples.
    """

    name: str
    weight: float
    mean: float | None
    greedy: float | None
    binary: bool
    pass_at: dict[int, float] = field(default_factory=dict)


@dataclass
class EvalResult:
    """What an evaluation measured.

    Attributes:
        num_prompts: eval prompts.
        num_generations: sampled completions per prompt (``num_generations_eval``).
        reward: mean weighted reward of the sampled completions.
        greedy_reward: mean weighted reward of the greedy completions.
        rewards: one summary per reward, in config order.
        mean_length: mean length of the sampled completions in tokens (EOS included).
        clipped_ratio: fraction of sampled completions cut at max_completion_length.
        greedy_mean_length: mean length of the greedy completions.
        seconds: wall time of the evaluation.
        model: what was evaluated (``base``, a checkpoint, or ``step N`` during training).
    """

    num_prompts: int
    num_generations: int
    reward: float | None
    greedy_reward: float | None
    rewards: list[RewardSummary]
    mean_length: float
    clipped_ratio: float
    greedy_mean_length: float
    seconds: float = 0.0
    model: str = ""

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics as training logs them (``eval/reward``, ``eval/rewards/<name>/pass@8``,
        ...); values that do not exist (a reward that scored nothing) are left out."""
        out: dict[str, float | None] = {
            "reward": self.reward,
            "greedy/reward": self.greedy_reward,
        }
        for r in self.rewards:
            out[f"rewards/{r.name}/mean"] = r.mean
            out.update({f"rewards/{r.name}/pass@{k}": v for k, v in r.pass_at.items()})
            out[f"rewards/{r.name}/greedy"] = r.greedy
        out.update(
            {
                "completions/mean_length": self.mean_length,
                "completions/clipped_ratio": self.clipped_ratio,
                "greedy/mean_length": self.greedy_mean_length,
                "num_prompts": float(self.num_prompts),
                "seconds": self.seconds,
            }
        )
        return {prefix + k: float(v) for k, v in out.items() if v is not None}

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (``grpo-plugins eval --json``)."""
        return {
            "model": self.model,
            "num_prompts": self.num_prompts,
            "num_generations_eval": self.num_generations,
            "reward": self.reward,
            "greedy_reward": self.greedy_reward,
            "rewards": [
                {
                    "name": r.name,
                    "weight": r.weight,
                    "mean": r.mean,
                    "greedy": r.greedy,
                    "binary": r.binary,
                    **{f"pass@{k}": v for k, v in r.pass_at.items()},
                }
                for r in self.rewards
            ],
            "mean_length": self.mean_length,
            "clipped_ratio": self.clipped_ratio,
            "greedy_mean_length": self.greedy_mean_length,
            "seconds": self.seconds,
            "metrics": self.metrics(),
        }


def _mean(x: Tensor) -> float | None:
    value = float(x.double().nanmean()) if x.numel() else math.nan
    return value if math.isfinite(value) else None


def summarise(
    sample_rewards: Tensor,
    sample_lengths: Tensor,
    sample_truncated: Tensor,
    greedy_rewards: Tensor,
    greedy_lengths: Tensor,
    names: Sequence[str],
    weights: Sequence[float],
) -> EvalResult:
    """The :class:`EvalResult` of scored completions.

    Args:
        sample_rewards: (P, n, K) scores of the n sampled completions of each of P prompts; NaN
            where a reward returned None.
        sample_lengths: (P, n) their lengths in tokens.
        sample_truncated: (P, n) bool, cut at max_completion_length.
        greedy_rewards: (P, K) scores of each prompt's greedy completion.
        greedy_lengths: (P,) its length.
        names, weights: the K rewards.
    """
    import torch

    from grpo_plugins.advantages import combine_rewards

    P, n, K = sample_rewards.shape
    r = sample_rewards.double()
    combined = combine_rewards(r.reshape(P * n, K), list(weights))  # (P*n,)
    summaries = []
    for k, (name, weight) in enumerate(zip(names, weights)):
        col = r[:, :, k]  # (P, n)
        scored = ~torch.isnan(col)
        binary = bool(scored.any()) and bool(((col == 0) | (col == 1))[scored].all())
        pass_at: dict[int, float] = {}
        if binary:
            counts, correct = scored.sum(1).tolist(), (col == 1).sum(1).tolist()  # per prompt
            for kk in sorted({1, n}):
                values = [pass_at_k(ni, ci, kk) for ni, ci in zip(counts, correct) if ni >= kk]
                if values:
                    pass_at[kk] = sum(values) / len(values)
        summaries.append(
            RewardSummary(name, float(weight), _mean(col), _mean(greedy_rewards[:, k]), binary, pass_at)
        )
    return EvalResult(
        num_prompts=P,
        num_generations=n,
        reward=_mean(combined),
        greedy_reward=_mean(combine_rewards(greedy_rewards.double().reshape(P, K), list(weights))),
        rewards=summaries,
        mean_length=_mean(sample_lengths.double()) or 0.0,
        clipped_ratio=_mean(sample_truncated.double()) or 0.0,
        greedy_mean_length=_mean(greedy_lengths.double()) or 0.0,
    )
