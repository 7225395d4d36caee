"""One generation cycle's data: generate -> score -> advantages -> old/reference log-probs.

:class:`RolloutMaker` turns the prompts that the :class:`~grpo_plugins.batching.BatchPlan`
assigns to this process for a cycle into a :class:`Rollout`: the token tensors, the loss mask,
one advantage per completion (computed over the whole, gathered batch), and the log-probs the
micro-steps need. :class:`PromptStream` is the run's prompt order.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.batching import BatchPlan, Step
from grpo_plugins.config import GRPOConfig
from grpo_plugins.console import phase
from grpo_plugins.errors import TrainingError
from grpo_plugins.guards import RunGuard
from grpo_plugins.metrics import MetricsWriter, completion_metrics, reward_metrics
from grpo_plugins.registry import Registry


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

    def to_state(self) -> dict[str, Any]:
        """The fields as a dict (what a mid-cycle checkpoint saves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device | str = "cpu") -> Rollout:
        """The rollout saved by :meth:`to_state`, its tensors moved to ``device``."""
        return cls(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in state.items()})


@dataclass
class Round:
    """One generate-and-score pass over this process's L rows (before any gathering)."""

    prompt_index: list[int]  # (L,)
    prompt_ids: list[list[int]]  # (L,) token ids of each row's prompt
    prompts: list[Any]  # (L,) the prompts as the dataset holds them
    completion_ids: Tensor  # (L, T)
    completion_mask: Tensor  # (L, T) long
    truncated: Tensor  # (L,) bool
    sampling_logps: Tensor | None  # (L, T) when the run keeps them (keeps_sampling_logps)
    local_rewards: Tensor  # (L, K)
    texts: list[Any]  # (L,) decoded completions, or the environment's (e.g. conversations)
    generate_seconds: float
    reward_seconds: float
    model_mask: Tensor | None = None  # (L, T) long: the model's tokens (None: completion_mask)
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # env/*, whole batch


@dataclass
class Share:
    """This process's share of the batch a cycle trains on, before advantages: one round as
    generated, or what dynamic sampling assembled from several."""

    prompt_index: list[int]  # (L,) -1 for a row of an empty slot
    prompt_ids: list[list[int]]
    prompts: list[Any]
    completion_ids: Tensor  # (L, T)
    completion_mask: Tensor  # (L, T) long
    truncated: Tensor  # (L,) bool
    sampling_logps: Tensor | None  # (L, T)
    local_rewards: Tensor  # (L, K)
    all_rewards: Tensor  # (N, K) the whole batch, gathered; NaN rows for empty slots
    texts: list[str]  # (L,)
    metrics: dict[str, float]
    num_tokens: int  # prompt + completion tokens generated for it, all processes
    generate_seconds: float
    reward_seconds: float
    next_prompt: int  # the prompt stream's position after it
    nonfinite: str | None = None
    empty: Tensor | None = None  # (L,) bool: rows of empty slots (masked out of the loss)
    model_mask: Tensor | None = None  # (L, T) long: the model's tokens (None: completion_mask)


class RewardFailed(Exception):
    """A reward failed on some process during a rollout (``error`` is what to raise)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class PromptStream:
    """The run's prompt order: the dataset shuffled with a fresh seeded permutation per epoch.

    ``row(i)`` is the dataset row behind prompt index ``i`` (the index ``plan`` shows).
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._epoch: int = -1
        self._perm: list[int] = []

    def row(self, index: int) -> int:
        epoch, pos = divmod(index, self.size)
        if not self.shuffle:  # shuffle_dataset: false
            return pos
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.size, generator=generator).tolist()
            self._epoch = epoch
        return self._perm[pos]


def accumulation_windows(steps: Sequence[Step]) -> list[int]:
    """For each micro-step of a cycle, the index of the accumulation window it belongs to."""
    out, w = [], 0
    for step in steps:
        out.append(w)
        if step.optimizer_update:
            w += 1
    return out


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


def corrects_rollouts(setting: bool | str, generator: Any) -> bool:
    """Whether the rollout correction is on: ``vllm_importance_sampling_correction`` true, or
    "auto" and the generator does not sample from the trained policy (``samples_from_policy``
    False, e.g. vLLM). "auto" has this one meaning everywhere."""
    if setting == "auto":
        return not getattr(generator, "samples_from_policy", True)
    return bool(setting)


def keeps_sampling_logps(setting: bool | str, generator: Any) -> bool:
    """Whether a run keeps the sampler's log-probs and passes them to every micro-step.

    Whenever the generator does not sample from the trained policy, whatever the correction
    setting: every piece of the objective that reads the sampler -- the rollout correction, the
    off-policy mask, the ``sampling/sampling_logp_difference`` metrics -- then needs the
    sampler's own numbers, which the old policy's log-probs do not stand in for. And whenever
    the correction is forced on (``true``), with any generator. A generator that samples from
    the policy keeps none otherwise: the old policy's log-probs are the sampler's there (TRL
    without vLLM). :func:`~grpo_plugins.objective.compute_loss` reads "auto" from whether it is
    given sampler log-probs, which this rule passes exactly when "auto" corrects.
    """
    return corrects_rollouts(setting, generator) or not getattr(generator, "samples_from_policy", True)


def score_completions(
    tokenizer: Any,
    rewards: Any,
    prompts: list[Any],
    completion_ids: Tensor,
    lengths: Tensor,
    columns: dict[str, list[Any]],
    step: int,
) -> tuple[Tensor, list[str]]:
    """Decode completions (B, T) cut at ``lengths`` (B,) and score them with the
    :class:`~grpo_plugins.rewards.RewardRunner` ``rewards``: ((B, K) rewards, NaN for None; texts).

    Raises:
        RewardError: a reward failed (see the runner's ``on_error``).
    """
    ids, ends = completion_ids.cpu(), lengths.tolist()  # one copy to the host, not a sync per row
    id_lists = [ids[i, : int(ends[i])].tolist() for i in range(len(prompts))]
    texts = tokenizer.batch_decode(id_lists, skip_special_tokens=True)
    return rewards(prompts, texts, id_lists, columns, step=step), texts


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


class RolloutMaker:
    """Makes the :class:`Rollout` of each generation cycle for one process.

    Args:
        config: the run config.
        accelerator: the run's ``accelerate.Accelerator``.
        plan: the batch plan.
        policy: the model being trained.
        tokenizer: its tokenizer.
        dataset: the prompts (a ``datasets.Dataset``) and any columns the rewards read.
        prompt_column: the dataset column holding the prompt.
        environment: the built environment (set up already with the run's generator): it
            turns prompts into episodes (``single_turn``: one completion each).
        rewards: the run's :class:`~grpo_plugins.rewards.RewardRunner`.
        scaling: the built ``reward_scaling`` component.
        correction: whether the rollout correction is on (the sampler's log-probs are required).
        guard: the run's guard (NaN/inf checks).
        registry: the run's registry.
        group_filter: the built ``group_filter`` component (used when ``plan.group_filter`` is
            set, i.e. the filter drops groups).
        keep_sampling_logps: whether rollouts carry the sampler's log-probs (see
            :func:`keeps_sampling_logps`); None: exactly when ``correction`` is on.
    """

    def __init__(
        self,
        config: GRPOConfig,
        accelerator: Any,
        plan: BatchPlan,
        policy: Policy,
        tokenizer: Any,
        dataset: Any,
        prompt_column: str,
        environment: Any,
        rewards: Any,
        scaling: Any,
        correction: bool,
        guard: RunGuard,
        registry: Registry,
        group_filter: Any = None,
        keep_sampling_logps: bool | None = None,
    ) -> None:
        self.config, self.accelerator, self.plan, self.policy = config, accelerator, plan, policy
        self.keep_sampling_logps = correction if keep_sampling_logps is None else keep_sampling_logps or correction
        self.tokenizer, self.dataset, self.prompt_column = tokenizer, dataset, prompt_column
        self.environment, self.rewards, self.scaling = environment, rewards, scaling
        self.correction, self.guard, self.registry = correction, guard, registry
        self.group_filter = group_filter
        self.stream = PromptStream(len(dataset), config.seed, config.shuffle_dataset)

    def make(
        self, cycle: int, step_number: int, writer: MetricsWriter | None = None, first_prompt: int | None = None
    ) -> Rollout:
        """The rollout of ``cycle``; ``step_number`` is the optimizer step it leads to (for
        messages and logged completions); ``first_prompt`` is the prompt stream's position
        (default ``cycle * unique_prompts``, where every cycle consumes exactly its prompts; a
        group filter that refills consumes more, see :mod:`grpo_plugins.dynamic_sampling`).

        Raises:
            RewardFailed: a reward failed on some process.
            NonFiniteError: a NaN/inf reward or advantage with ``on_nonfinite: stop``.
        """
        from grpo_plugins.data import left_pad

        cfg, acc, plan = self.config, self.accelerator, self.plan
        if first_prompt is None:
            first_prompt = cycle * plan.unique_prompts
        if plan.group_filter is None:
            share = self._plain_share(first_prompt, step_number)
        else:
            from grpo_plugins.dynamic_sampling import refill

            share = refill(self, first_prompt, step_number)
        advantages, nonfinite = self._advantages(share.all_rewards, step_number)  # (L,)
        completion_mask = share.completion_mask

        # Only the model's tokens carry the loss (not tool results or template tokens between turns).
        loss_mask = (share.model_mask if share.model_mask is not None else completion_mask).float()  # (L, T)
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~share.truncated).float().unsqueeze(1)
        if share.empty is not None:  # empty slots of a short dynamic-sampling batch train on nothing
            loss_mask = loss_mask * (~share.empty).float().unsqueeze(1)
        prompt_tensor, prompt_mask = left_pad(share.prompt_ids, self.tokenizer.pad_token_id, device=acc.device)  # (L, P)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (L, P+T)
        steps = plan.cycle(cycle, acc.process_index)
        if cfg.log_completions and writer is not None:
            empty = share.empty.tolist() if share.empty is not None else [False] * len(share.prompts)
            keep = [i for i in range(len(share.prompts)) if not empty[i]]
            self._log_completions(
                writer, step_number, [share.prompts[i] for i in keep], [share.texts[i] for i in keep],
                share.local_rewards[keep], advantages[keep],
            )

        rollout = Rollout(
            prompt_index=list(share.prompt_index),
            input_ids=torch.cat([prompt_tensor, share.completion_ids], dim=1),  # (L, P+T)
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logps=None,
            ref_logps=None,
            sampling_logps=share.sampling_logps,
            window_items=self._window_items(loss_mask, steps),
            metrics=share.metrics,
            num_tokens=share.num_tokens,
            generate_seconds=share.generate_seconds,
            reward_seconds=share.reward_seconds,
            nonfinite=share.nonfinite or nonfinite,
            next_prompt=share.next_prompt,
        )
        with self.guard.phase("log-probs", step_number):
            if not (self.plan.on_policy and self.config.beta == 0.0):
                phase(f"log-probs step {step_number}")
            self._add_logps(rollout, steps)
        return rollout

    def prompts_for(self, indices: Sequence[int]) -> tuple[list[Any], list[list[int]], dict[int, Any]]:
        """The prompts behind prompt-stream ``indices``: (prompts, their token ids, the dataset
        row of each distinct index)."""

        cfg = self.config
        unique = sorted(set(indices))
        rows = {i: self.dataset[self.stream.row(i)] for i in unique}
        encoded = self.environment.encode_prompts(
            [rows[i][self.prompt_column] for i in unique], cfg.max_prompt_length, cfg.prompt_truncation
        )
        ids_of = dict(zip(unique, encoded))
        return [rows[i][self.prompt_column] for i in indices], [list(ids_of[i]) for i in indices], rows

    def generate_round(self, indices: list[int], step_number: int) -> Round:
        """Generate and score one completion per entry of ``indices`` (this process's rows)."""
        acc = self.accelerator
        prompts, prompt_ids, rows = self.prompts_for(indices)
        columns = {n: [rows[i][n] for i in indices] for n in self.dataset.column_names if n != self.prompt_column}
        phase(f"generating step {step_number}")
        t0 = time.perf_counter()
        with torch.no_grad():
            episodes = self.environment.run(prompts, prompt_ids, columns)
        generate_seconds = time.perf_counter() - t0
        if episodes.stats and self.plan.group_filter is not None:
            raise TrainingError(
                "a group_filter that drops groups (dynamic sampling) does not work with a multi-turn "
                "environment yet; use environment: single_turn or a group_filter that keeps every group"
            )

        completion_ids = episodes.completion_ids.to(acc.device)  # (L, T) the model's and the environment's tokens
        completion_mask = episodes.completion_mask.to(acc.device).long()  # (L, T) attention
        model_mask = episodes.model_mask.to(acc.device).long()  # (L, T) the model's tokens
        truncated = episodes.is_truncated.to(acc.device).bool()  # (L,)
        columns = self._with_info(columns, episodes.info)

        phase(f"scoring step {step_number}")
        t0 = time.perf_counter()
        local_rewards, texts = self._score(
            prompts, completion_ids, model_mask, columns, step_number, episodes.completions
        )  # (L, K)
        return Round(
            prompt_index=list(indices), prompt_ids=prompt_ids, prompts=prompts, completion_ids=completion_ids,
            completion_mask=completion_mask, truncated=truncated, sampling_logps=self._sampling_logps(episodes),
            local_rewards=local_rewards, texts=texts, generate_seconds=generate_seconds,
            reward_seconds=time.perf_counter() - t0, model_mask=model_mask,
            episode_metrics=self._episode_metrics(episodes.stats, completion_mask, model_mask),
        )

    def _plain_share(self, first_prompt: int, step_number: int) -> Share:
        """The cycle's batch as generated: one round of ``unique_prompts`` prompts."""
        acc, plan = self.accelerator, self.plan
        G = plan.num_generations
        indices = [first_prompt + c // G for c in range(plan.effective_batch_size)][plan.process_rows(acc.process_index)]
        r = self.generate_round(indices, step_number)
        all_rewards = acc.gather(r.local_rewards)  # (N, K) N = L * num_processes, process order
        lengths = r.model_mask.sum(1) if r.model_mask is not None else r.completion_mask.sum(1)  # (L,) model tokens
        local_tokens = sum(len(p) for p in r.prompt_ids) + r.completion_mask.sum()
        return Share(
            prompt_index=r.prompt_index, prompt_ids=r.prompt_ids, prompts=r.prompts, completion_ids=r.completion_ids,
            completion_mask=r.completion_mask, model_mask=r.model_mask, truncated=r.truncated, sampling_logps=r.sampling_logps,
            local_rewards=r.local_rewards, all_rewards=all_rewards, texts=r.texts,
            metrics={
                **reward_metrics(all_rewards, self.rewards.names, self.rewards.weights, G),
                **completion_metrics(acc.gather(lengths), acc.gather(r.truncated.long()).bool()),
                **r.episode_metrics,
            },
            num_tokens=int(acc.reduce(torch.as_tensor(local_tokens, device=acc.device).double(), reduction="sum")),
            generate_seconds=r.generate_seconds, reward_seconds=r.reward_seconds,
            next_prompt=first_prompt + plan.unique_prompts,
        )

    # -- the stages ----------------------------------------------------------------------------

    def _with_info(self, columns: dict[str, list[Any]], info: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The dataset columns plus the environment's per-episode info columns."""
        clash = sorted(set(info) & (set(columns) | {self.prompt_column}))
        if clash:
            raise TrainingError(
                f"the environment's info column(s) {clash} have the name of dataset columns; rename one of them"
            )
        return {**columns, **info}

    def _episode_metrics(self, stats: dict[str, list[float]], completion_mask: Tensor, model_mask: Tensor) -> dict[str, float]:
        """``env/<stat>`` means over the whole batch (turns, tool calls, ...), and the tokens per
        episode by source: ``env/model_tokens``, ``env/environment_tokens``. Nothing for a
        single-turn environment (it reports no stats)."""
        if not stats:
            return {}
        acc = self.accelerator
        names = sorted(stats)
        local = torch.tensor([stats[n] for n in names], dtype=torch.float64, device=acc.device).T  # (L, S)
        model = model_mask.sum(1).double()  # (L,)
        other = (completion_mask.sum(1) - model_mask.sum(1)).double()  # (L,)
        table = acc.gather(torch.cat([local, model[:, None], other[:, None]], dim=1)).mean(0).tolist()  # (S + 2,)
        keys = [f"env/{n}" for n in names] + ["env/model_tokens", "env/environment_tokens"]
        return dict(zip(keys, table))

    def _score(
        self,
        prompts: list[Any],
        completion_ids: Tensor,
        model_mask: Tensor,
        columns: dict[str, list[Any]],
        step_number: int,
        completions: list[Any] | None = None,
    ) -> tuple[Tensor, list[Any]]:
        """(L, K) rewards of this process's episodes, and what the rewards saw as completions
        (the decoded model tokens, or the environment's ``completions``). A failure on any
        process raises RewardFailed on every process."""
        from grpo_plugins.rewards import RewardError

        acc = self.accelerator
        # One copy to the host, not one masked index (a kernel and a sync) per row.
        ids, keep = completion_ids.cpu(), model_mask.bool().cpu()
        id_lists = [ids[i][keep[i]].tolist() for i in range(len(prompts))]
        texts = completions if completions is not None else self.tokenizer.batch_decode(id_lists, skip_special_tokens=True)
        error: Exception | None = None
        try:
            local = self.rewards(prompts, texts, id_lists, columns, step=step_number - 1).to(acc.device)  # (L, K)
        except RewardError as exc:
            error = exc
            local = torch.zeros(len(prompts), len(self.rewards.names), device=acc.device)
        failed = acc.gather(torch.tensor([1.0 if error is not None else 0.0], device=acc.device))
        if bool(failed.any()):
            if error is None:
                error = TrainingError(f"a reward failed on process {int(failed.nonzero()[0])}; see its message")
            raise RewardFailed(error)
        return local, texts

    def _advantages(self, all_rewards: Tensor, step_number: int) -> tuple[Tensor, str | None]:
        """This process's (L,) advantages, computed over the whole gathered (N, K) reward table."""
        from grpo_plugins.advantages import compute_advantages

        acc, L = self.accelerator, self.plan.completions_per_process
        advantages_all = compute_advantages(
            all_rewards.double(),
            num_generations=self.plan.num_generations,
            reward_weights=self.rewards.weights,
            scale_rewards=self.scaling,
            multi_objective_aggregation=self.config.multi_objective_aggregation,
            registry=self.registry,
        ).float()  # (N,)
        nonfinite = self.guard.check_rollout(all_rewards, advantages_all, step_number)
        rank = acc.process_index
        return advantages_all[rank * L : (rank + 1) * L], nonfinite

    def _window_items(self, loss_mask: Tensor, steps: list[Step]) -> list[float]:
        """Active tokens of each accumulation window of the cycle, summed over all processes."""
        windows = accumulation_windows(steps)
        local = torch.zeros(max(windows) + 1, device=self.accelerator.device, dtype=torch.float64)
        for k, step in enumerate(steps):
            local[windows[k]] += loss_mask[step.rows].sum().double()
        return self.accelerator.reduce(local, reduction="sum").tolist()

    def _sampling_logps(self, out: Any) -> Tensor | None:
        if not self.keep_sampling_logps:
            return None
        if out.sampling_logps is None:
            if not self.correction:
                return None  # the off-policy mask falls back to the old log-probs, no gap metric
            raise TrainingError(
                "vllm_importance_sampling_correction is on but the generator returns no sampling "
                "log-probs; set vllm_importance_sampling_correction: false or use a generator that does"
            )
        return out.sampling_logps.to(self.accelerator.device).float()  # (L, T)

    def _add_logps(self, rollout: Rollout, steps: list[Step]) -> None:
        """Old log-probs when an update falls inside the cycle; reference ones when beta != 0
        (their seconds go to ``rollout.logprob_seconds``)."""
        if self.plan.on_policy and self.config.beta == 0.0:
            return
        t0 = time.perf_counter()
        policy = self.policy
        if not self.plan.on_policy:
            rollout.old_logps = self.batch_logps(rollout, policy.unwrapped, steps)
        if self.config.beta != 0.0:
            if policy.is_peft:
                with policy.unwrapped.disable_adapter():
                    rollout.ref_logps = self.batch_logps(rollout, policy.unwrapped, steps)
            else:
                rollout.ref_logps = self.batch_logps(rollout, policy.ref_model, steps)
        # Only the model's tokens have log-probs: 0 at the environment's (and masked) tokens.
        for name in ("old_logps", "ref_logps"):
            value = getattr(rollout, name)
            if value is not None:
                setattr(rollout, name, value * (rollout.loss_mask > 0))
        rollout.logprob_seconds = time.perf_counter() - t0

    def batch_logps(self, rollout: Rollout, model: Any, steps: list[Step]) -> Tensor:
        """(L, T) log-probs of the whole share, one micro-batch at a time, without gradients."""
        from grpo_plugins.logprobs import completion_logps
        from grpo_plugins.row_chunks import row_chunks

        cfg = self.config
        T = rollout.loss_mask.shape[1]
        out = torch.zeros_like(rollout.loss_mask)  # (L, T)
        with torch.no_grad(), self.accelerator.autocast(), self.policy.layers():
            for step in steps[: self.plan.steps_per_generation]:
                # Trimmed per micro-batch, as in the training step, so each row sees the same input.
                ids, att, t = trim_padding(
                    rollout.input_ids[step.rows], rollout.attention_mask[step.rows], T, self.policy.multiple
                )
                rows = out[step.rows]  # (B, T) view
                for c in row_chunks(ids.shape[0], cfg.train_chunk_rows):
                    logps, _ = completion_logps(
                        model, ids[c], att[c], t, temperature=cfg.temperature,
                        chunk_size=cfg.logprob_chunk_size, chunk_fn=self.policy.chunk_fn,
                    )  # (b, t)
                    rows[c, :t] = logps.float()
        return out

    def _log_completions(
        self, writer: MetricsWriter, step_number: int, prompts: list[Any], texts: list[str], rewards: Tensor, advantages: Tensor
    ) -> None:
        from accelerate.utils import gather_object

        names = self.rewards.names
        records = [
            {
                "prompt": p,
                "completion": c,
                "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, r.tolist())},
                "advantage": float(a),
            }
            for p, c, r, a in zip(prompts, texts, rewards.cpu(), advantages.cpu())
        ]
        records = gather_object(records) if self.accelerator.num_processes > 1 else records
        writer.log_completions(step_number, records)
        cfg = self.config
        if cfg.num_completions_to_print and self.accelerator.is_main_process:
            print_completions(records, cfg.num_completions_to_print, unique_prompts=cfg.log_unique_prompts, step=step_number)



def print_completions(records: list[dict[str, Any]], limit: int, *, unique_prompts: bool = False, step: int = 0) -> list[dict[str, Any]]:
    """Print up to ``limit`` completions of a step as a table on stderr (TRL's
    ``num_completions_to_print``; ``log_unique_prompts``: the first completion of each prompt
    only). Returns the records printed."""
    import sys

    from rich.console import Console
    from rich.table import Table

    shown: list[dict[str, Any]] = []
    seen: set[str] = set()
    for record in records:
        key = repr(record["prompt"])
        if unique_prompts and key in seen:
            continue
        seen.add(key)
        shown.append(record)
        if len(shown) >= limit:
            break
    table = Table(title=f"completions, step {step}", show_lines=True)
    for column in ("prompt", "completion", "rewards", "advantage"):
        table.add_column(column)
    for r in shown:
        prompt = r["prompt"] if isinstance(r["prompt"], str) else str(r["prompt"][-1].get("content", r["prompt"]))
        rewards = ", ".join(f"{k}={v:.3g}" if v is not None else f"{k}=None" for k, v in r["rewards"].items())
        table.add_row(prompt, r["completion"], rewards, f"{r['advantage']:.3g}")
    Console(file=sys.stderr, width=120).print(table)
    return shown
