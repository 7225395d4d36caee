"""Scoring finished episodes with the run's rewards: one scorer for training and evaluation.

:func:`score_episodes` gives each episode's (K,) rewards from what the environment returned:
the model's tokens decoded (or the environment's own ``completions``, e.g. conversations), the
dataset columns plus the environment's ``info`` columns. :func:`raise_if_any_failed` turns a
reward failure on any process into :class:`RewardFailed` on every process, so that all of them
stop at the same place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_plugins.errors import TrainingError


class RewardFailed(Exception):
    """A reward failed on some process (``error`` is what to raise)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def with_info(columns: dict[str, list[Any]], info: dict[str, list[Any]], prompt_column: str = "prompt") -> dict[str, list[Any]]:
    """The dataset columns plus the environment's per-episode info columns."""
    clash = sorted(set(info) & (set(columns) | {prompt_column}))
    if clash:
        raise TrainingError(
            f"the environment's info column(s) {clash} have the name of dataset columns; rename one of them"
        )
    return {**columns, **info}


def score_episodes(
    tokenizer: Any,
    rewards: Any,
    prompts: list[Any],
    completion_ids: Tensor,
    model_mask: Tensor,
    columns: dict[str, list[Any]],
    step: int,
    completions: list[Any] | None = None,
) -> tuple[Tensor, list[Any]]:
    """Score B episodes with the :class:`~grpo_plugins.rewards.RewardRunner` ``rewards``.

    Args:
        completion_ids: (B, T) every token after each prompt.
        model_mask: (B, T) the model's tokens: what the rewards get as ``completion_ids`` and,
            decoded, as completions (unless the environment gives ``completions``).
        columns: the other columns, one value per episode (``with_info`` adds the
            environment's).
        step: the optimizer steps done (``trainer_state.global_step``).

    Returns:
        ((B, K) rewards on the CPU, NaN for None; what the rewards saw as completions).

    Raises:
        RewardError: a reward failed (see the runner's ``on_error``).
    """
    # One copy to the host, not one masked index (a kernel and a sync) per row.
    ids, keep = completion_ids.cpu(), model_mask.bool().cpu()
    id_lists = [ids[i][keep[i]].tolist() for i in range(len(prompts))]
    texts = completions if completions is not None else tokenizer.batch_decode(id_lists, skip_special_tokens=True)
    return rewards(prompts, texts, id_lists, columns, step=step), texts


def raise_if_any_failed(accelerator: Any, error: Exception | None, during: str = "") -> None:
    """Raise :class:`RewardFailed` on every process when a reward failed on any (``error``: this
    process's failure; ``accelerator`` None: one process)."""
    if accelerator is not None and accelerator.num_processes > 1:
        failed = accelerator.gather(torch.tensor([0.0 if error is None else 1.0], device=accelerator.device))
        if bool(failed.any()) and error is None:
            error = TrainingError(f"a reward failed on process {int(failed.nonzero()[0])}{during}; see its message")
    if error is not None:
        raise RewardFailed(error)
