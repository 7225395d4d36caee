"""Dynamic sampling (DAPO): refill a cycle's batch until it holds only groups the filter keeps.

Used by :class:`~grpo_plugins.rollout.RolloutMaker` when the run's ``group_filter`` drops groups
(``plan.group_filter`` is set). A cycle then generates in *rounds*: round ``r`` takes the next
``unique_prompts`` prompts of the prompt stream and lays them out over the processes exactly as
a plain cycle does. After each round the rewards, completions and masks are gathered on every
process, the filter decides per group (the same decision everywhere: it sees the same gathered
tensors), and the kept groups fill the batch's slots in the order they were generated. Rounds
continue while slots are empty, at most ``max_refill_rounds`` extra ones. Then

* surplus kept groups (beyond ``unique_prompts``) are discarded;
* empty slots (the cap was hit) are filled with rows of round 0, their loss mask zeroed and their
  rewards NaN: they change no statistic, no advantage and no normaliser (the loss normaliser
  counts kept tokens only), and the plan's shapes stay as planned;
* each process takes its rows ``[p*L, (p+1)*L)`` of the assembled batch.

Everything a round consumes is a function of the prompt-stream position, the model weights and
the RNG state at the start of the cycle, so a run killed in the middle of a refill replays the
refill exactly when it resumes from its last checkpoint (which stores that position).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.batching import BatchPlan
from grpo_plugins.errors import TrainingError
from grpo_plugins.guards import RunGuard
from grpo_plugins.metrics import completion_metrics, reward_metrics
from grpo_plugins.rollout_batches import Round, Share

logger = logging.getLogger(__name__)


@dataclass
class GatheredRound:
    """One round of the whole batch (all processes), as every process sees it. E rows."""

    first_prompt: int  # prompt-stream index of the round's first group
    rewards: Tensor  # (E, K)
    completion_ids: Tensor  # (E, T) right-padded with the pad token
    completion_mask: Tensor  # (E, T) long
    truncated: Tensor  # (E,) bool
    sampling_logps: Tensor | None  # (E, T)


def gather_round(accelerator: Any, local: Round, first_prompt: int, pad_token_id: int) -> GatheredRound:
    """Gather one round's rows of every process (in process order) onto every process."""
    acc = accelerator

    def padded(x: Tensor, value: int | float) -> Tensor:
        return acc.gather(acc.pad_across_processes(x.contiguous(), dim=1, pad_index=value))

    logps = local.sampling_logps
    return GatheredRound(
        first_prompt=first_prompt,
        rewards=acc.gather(local.local_rewards.contiguous()),
        completion_ids=padded(local.completion_ids, pad_token_id),
        completion_mask=padded(local.completion_mask, 0),
        truncated=acc.gather(local.truncated.long()).bool(),
        sampling_logps=None if logps is None else padded(logps, 0),
    )


def filter_groups(component: Any, name: str, rewards: Tensor, weights: list[float], names: list[str], G: int) -> Tensor:
    """(E/G,) bool: the groups of one gathered round that ``component`` keeps (on the CPU)."""
    from grpo_plugins.advantages import combine_rewards

    r = rewards.detach().double().cpu()  # (E, K)
    total = combine_rewards(r, weights)  # (E,)
    try:
        keep = component.keep(r, total, list(names), G)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    groups = r.shape[0] // G
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (groups,):
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, Tensor) else type(keep).__name__
        raise TrainingError(f"group_filter '{name}': keep must return a ({groups},) bool tensor, got {got}")
    return keep.cpu()


def pad_columns(x: Tensor, width: int, value: int | float) -> Tensor:
    """Right-pad the columns of (E, T) ``x`` to ``width``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def refill(
    first_prompt: int,
    generate: Callable[[list[int]], Round],
    prompts_for: Callable[[Sequence[int]], tuple[list[Any], list[list[int]], Any]],
    accelerator: Any,
    plan: BatchPlan,
    guard: RunGuard,
    group_filter: Any,
    rewards: Any,
    tokenizer: Any,
    step_number: int,
    decode_texts: bool = False,
) -> Share:
    """Generate rounds from prompt ``first_prompt`` on until ``unique_prompts`` groups are kept
    (or ``max_refill_rounds`` extra rounds are spent) and return this process's share of the
    assembled batch.

    Args:
        generate: generates and scores this process's rows of the given prompt indices.
        prompts_for: (prompts, their token ids, ...) of prompt indices.
        group_filter: the built ``group_filter`` component (``plan.group_filter`` names it).
        rewards: the run's reward runner (its ``names`` and ``weights``).
        tokenizer: pads the gathered completions; decodes them when ``decode_texts`` (logged
            completions).
    """
    acc = accelerator
    assert plan.group_filter is not None, "refill runs only for a group filter that drops groups"
    U, G, E = plan.unique_prompts, plan.num_generations, plan.effective_batch_size
    rows = plan.process_rows(acc.process_index)
    pad_id = tokenizer.pad_token_id
    names, weights = list(rewards.names), list(rewards.weights)

    rounds: list[GatheredRound] = []
    slots: list[tuple[int, int]] = []  # (round, group) of each kept group, in generation order
    passed = dropped = 0
    nonfinite: str | None = None
    generate_seconds = reward_seconds = 0.0
    local_tokens = torch.zeros((), dtype=torch.float64, device=acc.device)
    for r in range(plan.max_refill_rounds + 1):
        start = first_prompt + r * U
        indices = [start + c // G for c in range(E)][rows]
        local = generate(indices)
        generate_seconds += local.generate_seconds
        reward_seconds += local.reward_seconds
        local_tokens += sum(len(p) for p in local.prompt_ids) + local.completion_mask.sum().double()
        gathered = gather_round(acc, local, start, pad_id)
        # inf rewards are caught in every round, dropped groups included.
        found = guard.check_rollout(gathered.rewards, torch.zeros(E, device=gathered.rewards.device), step_number)
        nonfinite = nonfinite or found
        keep = filter_groups(group_filter, plan.group_filter, gathered.rewards, weights, names, G)  # (U,)
        rounds.append(gathered)
        kept = keep.nonzero().flatten().tolist()
        passed += len(kept)
        dropped += U - len(kept)
        slots += [(r, g) for g in kept]
        if len(slots) >= U:
            break
    slots = slots[:U]
    n_kept = len(slots) * G  # rows of kept groups; the rest are empty slots

    # The assembled batch, in process order: (round, row) behind each row; empty slots borrow
    # round 0's rows (any valid sequence: they are masked out).
    sources = [(r, g * G + j) for r, g in slots for j in range(G)]
    sources += [(0, i) for i in range(n_kept, E)]
    index = torch.tensor([r * E + i for r, i in sources], device=acc.device)  # (E,)
    T = max(g.completion_ids.shape[1] for g in rounds)
    completion_ids = torch.cat([pad_columns(g.completion_ids, T, pad_id) for g in rounds])[index]  # (E, T)
    completion_mask = torch.cat([pad_columns(g.completion_mask, T, 0) for g in rounds])[index]  # (E, T)
    truncated = torch.cat([g.truncated for g in rounds])[index]  # (E,)
    generated_rewards = torch.cat([g.rewards for g in rounds])  # (R*E, K)
    rewards = generated_rewards[index].clone()  # (E, K)
    rewards[n_kept:] = float("nan")
    sampling_logps = None
    if rounds[0].sampling_logps is not None:
        sampling_logps = torch.cat([pad_columns(g.sampling_logps, T, 0.0) for g in rounds])[index][rows]  # type: ignore[arg-type]
    empty = torch.zeros(E, dtype=torch.bool, device=acc.device)
    empty[n_kept:] = True
    prompt_index = [rounds[r].first_prompt + i // G for r, i in sources]  # (E,)

    mine = prompt_index[rows]
    prompts, prompt_ids, _ = prompts_for(mine)
    local_ids, local_mask = completion_ids[rows], completion_mask[rows]
    texts: list[str] = []
    if decode_texts:
        lengths = local_mask.sum(1).tolist()
        texts = tokenizer.batch_decode(
            [local_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
        )

    metrics = dynamic_sampling_metrics(
        generated_rewards, rewards[:n_kept], names, weights, G,
        rounds=len(rounds), unique_prompts=U, dropped=dropped, surplus=passed - len(slots),
    )
    lengths_all = completion_mask.sum(1)  # (E,)
    trained = slice(0, n_kept) if n_kept else slice(0, E)
    metrics.update(completion_metrics(lengths_all[trained], truncated[trained]))
    if n_kept < E and acc.is_main_process:
        logger.warning(
            "group_filter '%s': %d of %d groups kept after %d generation round(s) (max_refill_rounds %d); "
            "training on the kept groups, the %d empty slot(s) are masked out",
            plan.group_filter, len(slots), U, len(rounds), plan.max_refill_rounds, U - len(slots),
        )
    empty_mine = empty[rows]
    assembled = Round(
        prompt_index=[-1 if bool(e) else i for i, e in zip(mine, empty_mine.tolist())],
        prompt_source=list(mine),
        prompt_ids=prompt_ids,
        prompts=prompts,
        completion_ids=local_ids,
        completion_mask=local_mask,
        model_mask=local_mask,  # single-turn episodes only: every token is the model's
        truncated=truncated[rows],
        sampling_logps=sampling_logps,
        local_rewards=rewards[rows],
        texts=texts,
        generate_seconds=generate_seconds,
        reward_seconds=reward_seconds,
    )
    return Share(
        rows=assembled,
        all_rewards=rewards,
        metrics=metrics,
        num_tokens=int(acc.reduce(local_tokens, reduction="sum")),
        next_prompt=first_prompt + len(rounds) * U,
        nonfinite=nonfinite,
        empty=empty_mine,
    )


def dynamic_sampling_metrics(
    generated: Tensor,
    trained: Tensor,
    names: list[str],
    weights: list[float],
    G: int,
    *,
    rounds: int,
    unique_prompts: int,
    dropped: int,
    surplus: int,
) -> dict[str, float]:
    """The reward metrics of the trained batch (TRL's names) plus ``group_filter/*``.

    Args:
        generated: (R*E, K) rewards of every completion generated this cycle.
        trained: (n, K) rewards of the kept groups the cycle trains on (n may be 0).
        rounds: generation rounds used (1 + refill rounds).
        dropped: groups the filter dropped; surplus: kept groups beyond the batch, discarded.
    """
    generated_metrics = reward_metrics(generated, names, weights, G)
    if trained.shape[0]:
        out = reward_metrics(trained, names, weights, G)
    else:  # nothing kept: nothing is trained; the reward metrics describe what was generated
        out = {**generated_metrics, "frac_reward_zero_std": 0.0}
    generated_groups = rounds * unique_prompts
    kept = trained.shape[0] // G
    out.update(
        {
            "group_filter/rounds": float(rounds),
            "group_filter/generations": float(generated.shape[0]),
            "group_filter/extra_generations": float(generated.shape[0] - generated.shape[0] // rounds),
            "group_filter/groups_generated": float(generated_groups),
            "group_filter/groups_dropped": float(dropped),
            "group_filter/groups_surplus": float(surplus),
            "group_filter/filtered_fraction": dropped / generated_groups,
            "group_filter/empty_slots": float(unique_prompts - kept),
            "group_filter/cap_hit": 1.0 if kept < unique_prompts else 0.0,
            "group_filter/generated_reward": generated_metrics["reward"],
            "group_filter/generated_frac_reward_zero_std": generated_metrics["frac_reward_zero_std"],
        }
    )
    return out
