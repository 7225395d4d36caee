"""Requests to and outputs from vLLM: GRPO's groups of identical prompts as one request with
``n`` samples, and the log-probs of the sampled tokens."""

from __future__ import annotations

from typing import Any


def group_repeats(prompt_ids: list[list[int]]) -> tuple[list[list[int]], int]:
    """(unique prompts, n) when the prompts are runs of equal length n of identical prompts
    (GRPO's groups), else (prompts, 1)."""
    runs: list[list[int]] = []
    sizes: list[int] = []
    for ids in prompt_ids:
        if runs and runs[-1] == ids:
            sizes[-1] += 1
        else:
            runs.append(list(ids))
            sizes.append(1)
    if sizes and len(set(sizes)) == 1 and sizes[0] > 1:
        return runs, sizes[0]
    return [list(p) for p in prompt_ids], 1


def _sampled_logprob(entry: Any, token: int) -> float:
    value = entry[token]
    return float(value.logprob if hasattr(value, "logprob") else value)


def sampled_logprobs(container: Any, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token from a completion's ``logprobs``: vLLM's
    ``FlatLogprobs`` (flat lists with per-position ranges) or a list of per-position dicts."""
    if hasattr(container, "start_indices"):  # FlatLogprobs: read its lists, build no dicts
        ids, values, starts, ends = container.token_ids, container.logprobs, container.start_indices, container.end_indices
        out = []
        for i, t in enumerate(tokens):
            j = next((j for j in range(starts[i], ends[i]) if ids[j] == t), None)
            if j is None:
                raise KeyError(f"vLLM returned no log-prob for the sampled token {t} at position {i}")
            out.append(float(values[j]))
        return out
    return [_sampled_logprob(container[i], t) for i, t in enumerate(tokens)]
