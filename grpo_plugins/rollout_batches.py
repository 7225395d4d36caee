"""The batches a generation cycle passes along: :class:`Round` (one generate-and-score pass over
this process's rows) -> :class:`Share` (the rows the cycle trains on, with the whole batch's
rewards) -> :class:`Rollout` (tensors, advantages and log-probs ready for the micro-steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Round:
    """One generate-and-score pass over this process's L rows (before any gathering), or the rows
    dynamic sampling assembled from several such passes."""

    prompt_index: list[int]  # (L,) position of each row's prompt in the prompt stream; -1: an empty slot
    prompt_ids: list[list[int]]  # (L,) token ids of each row's prompt
    prompts: list[Any]  # (L,) the prompts as the dataset holds them
    completion_ids: Tensor  # (L, T)
    completion_mask: Tensor  # (L, T) long
    model_mask: Tensor  # (L, T) long: the model's tokens (the rest are the environment's)
    truncated: Tensor  # (L,) bool
    sampling_logps: Tensor | None  # (L, T) when the run keeps them (keeps_sampling_logps)
    local_rewards: Tensor  # (L, K)
    texts: list[Any]  # (L,) what the rewards saw as completions
    generate_seconds: float
    reward_seconds: float
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # env/*, whole batch
    prompt_source: list[int] | None = None  # (L,) the prompt each row's tokens are, where prompt_index says -1


@dataclass
class Share:
    """This process's share of the batch a cycle trains on, before advantages: one round as
    generated, or what dynamic sampling assembled from several."""

    rows: Round  # this process's L rows
    all_rewards: Tensor  # (N, K) the whole batch, gathered; NaN rows for empty slots
    metrics: dict[str, float]
    num_tokens: int  # prompt + completion tokens generated for it, all processes
    next_prompt: int  # the prompt stream's position after it
    nonfinite: str | None = None
    empty: Tensor | None = None  # (L,) bool: rows of empty slots (masked out of the loss)


@dataclass
class Rollout:
    """One process's share of a generation batch, ready for the micro-steps.

    L rows (``plan.completions_per_process``); P prompt and T completion columns.
    """

    prompt_index: list[int]  # (L,) position of each row's prompt in the run's prompt stream
    input_ids: Tensor  # (L, P+T) left-padded prompt, then right-padded completion
    attention_mask: Tensor  # (L, P+T)
    loss_mask: Tensor  # (L, T) float completion mask, truncated rows zeroed when masking them
    advantages: Tensor  # (L,)
    old_logps: Tensor | None  # (L, T) when off-policy steps need them
    ref_logps: Tensor | None  # (L, T) when beta != 0
    sampling_logps: Tensor | None  # (L, T) when the run keeps them (keeps_sampling_logps)
    window_items: list[float]  # active tokens of each accumulation window, all processes
    metrics: dict[str, float]  # reward and completion statistics of the whole batch
    num_tokens: int  # prompt + completion tokens of the whole batch (all processes)
    generate_seconds: float
    reward_seconds: float
    nonfinite: str | None = None  # the component that produced a NaN/inf reward or advantage
    next_prompt: int = 0  # the prompt stream's position after this rollout (the next cycle's first)
    logprob_seconds: float = 0.0  # the old/reference log-prob passes
    prompt_source: list[int] | None = None  # (L,) the prompt each row's tokens are, where prompt_index says -1

    def input_prompts(self) -> list[int]:
        """(L,) the prompt whose tokens (and images) each row holds: ``prompt_index``, except at
        dynamic sampling's empty slots, which borrow another row's sequence."""
        return self.prompt_source if self.prompt_source is not None else self.prompt_index

    def to_state(self) -> dict[str, Any]:
        """The fields as a dict (what a mid-cycle checkpoint saves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device | str = "cpu") -> Rollout:
        """The rollout saved by :meth:`to_state`, its tensors moved to ``device``."""
        return cls(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in state.items()})
