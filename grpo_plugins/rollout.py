"""One generation cycle's pipeline: generate -> score -> advantages -> old/reference log-probs.

:class:`RolloutMaker` turns the prompts that the :class:`~grpo_plugins.batching.BatchPlan`
assigns to this process for a cycle into a :class:`~grpo_plugins.rollout_batches.Rollout`: the
token tensors, the loss mask, one advantage per completion (computed over the whole, gathered
batch), and the log-probs the micro-steps need. The episodes come from the run's environment
(:mod:`grpo_plugins.episodes`), their scores from :mod:`grpo_plugins.scoring`, the prompts from
:mod:`grpo_plugins.prompts`; a group filter that drops groups refills the batch
(:mod:`grpo_plugins.dynamic_sampling`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.ahead import AheadGeneration
from grpo_plugins.batching import BatchPlan, Step
from grpo_plugins.config import GRPOConfig
from grpo_plugins.console import phase, print_completions
from grpo_plugins.dropout import dropout_in
from grpo_plugins.dynamic_sampling import refill
from grpo_plugins.errors import TrainingError
from grpo_plugins.guards import RunGuard
from grpo_plugins.metrics import MetricsWriter, completion_metrics, reward_metrics
from grpo_plugins.policy import Policy, groups_by_length, plan_passes
from grpo_plugins.prompts import PromptSource
from grpo_plugins.rollout_batches import Rollout, Round, Share
from grpo_plugins.scoring import raise_if_any_failed, score_episodes, with_info

__all__ = ["RolloutMaker", "accumulation_windows", "corrects_rollouts", "keeps_sampling_logps"]


def accumulation_windows(steps: Sequence[Step]) -> list[int]:
    """For each micro-step of a cycle, the index of the accumulation window it belongs to."""
    out, w = [], 0
    for step in steps:
        out.append(w)
        if step.optimizer_update:
            w += 1
    return out


def _samples_from_policy(generator: Any, ahead: bool) -> bool:
    # One step ahead, the sampler is the policy before the last optimizer step.
    return getattr(generator, "samples_from_policy", True) and not ahead


def corrects_rollouts(setting: bool | str, generator: Any, ahead: bool = False) -> bool:
    """Whether the rollout correction is on: ``vllm_importance_sampling_correction`` true, or
    "auto" and the samples do not come from the trained policy (a generator whose
    ``samples_from_policy`` is False, e.g. vLLM, or ``ahead``: ``generate_ahead``). "auto" has
    this one meaning everywhere."""
    if setting == "auto":
        return not _samples_from_policy(generator, ahead)
    return bool(setting)


def keeps_sampling_logps(setting: bool | str, generator: Any, ahead: bool = False) -> bool:
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
    return corrects_rollouts(setting, generator, ahead) or not _samples_from_policy(generator, ahead)


class RolloutMaker:
    """Makes the :class:`Rollout` of each generation cycle for one process.

    Args:
        config: the run config.
        accelerator: the run's ``accelerate.Accelerator``.
        plan: the batch plan.
        policy: the model being trained.
        prompts: the run's prompts, in the run's order.
        environment: the built environment (set up already with the run's generator and
            tokenizer): it turns prompts into episodes (``single_turn``: one completion each).
        rewards: the run's :class:`~grpo_plugins.rewards.RewardRunner`.
        guard: the run's guard (NaN/inf checks).
        advantages_of: (N, K) gathered rewards -> (N,) advantages (the run's settings applied).
        group_filter: the built ``group_filter`` component (used when ``plan.group_filter`` is
            set, i.e. the filter drops groups).
    """

    def __init__(
        self,
        config: GRPOConfig,
        accelerator: Any,
        plan: BatchPlan,
        policy: Policy,
        prompts: PromptSource,
        environment: Any,
        rewards: Any,
        guard: RunGuard,
        advantages_of: Callable[[Tensor], Tensor],
        group_filter: Any = None,
    ) -> None:
        self.config, self.accelerator, self.plan, self.policy = config, accelerator, plan, policy
        self.prompts, self.environment, self.tokenizer = prompts, environment, environment.tokenizer
        self.rewards, self.guard, self.advantages_of, self.group_filter = rewards, guard, advantages_of, group_filter
        setting, generator = config.vllm_importance_sampling_correction, environment.generator
        self.correction = corrects_rollouts(setting, generator, config.generate_ahead)
        self.keep_sampling_logps = keeps_sampling_logps(setting, generator, config.generate_ahead)
        self.ahead: AheadGeneration | None = None
        if config.generate_ahead:
            if plan.group_filter is not None:
                raise TrainingError(
                    "generate_ahead does not work with a group_filter that drops groups (dynamic sampling) yet: "
                    "its refills depend on the batch before; set generate_ahead: false or use a filter that keeps every group"
                )
            dropout = dropout_in(policy.unwrapped)
            if dropout is not None:
                raise TrainingError(
                    f"generate_ahead: the training pass draws random numbers (dropout: {dropout}) from the stream the "
                    "next batch samples from beside it; use a model without dropout or set generate_ahead: false"
                )
            self.ahead = AheadGeneration(environment, accelerator.device)

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
            share = refill(
                first_prompt, lambda indices: self.generate_round(indices, step_number), self.prompts.prompts_for,
                acc, plan, self.guard, self.group_filter, self.rewards, self.tokenizer, step_number,
                decode_texts=cfg.log_completions,
            )
        advantages, nonfinite = self._advantages(share.all_rewards, step_number)  # (L,)
        rows = share.rows

        # Only the model's tokens carry the loss (not tool results or template tokens between turns).
        loss_mask = rows.model_mask.float()  # (L, T)
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~rows.truncated).float().unsqueeze(1)
        if share.empty is not None:  # empty slots of a short dynamic-sampling batch train on nothing
            loss_mask = loss_mask * (~share.empty).float().unsqueeze(1)
        prompt_tensor, prompt_mask = left_pad(rows.prompt_ids, self.tokenizer.pad_token_id, device=acc.device)  # (L, P)
        attention_mask = torch.cat([prompt_mask, rows.completion_mask], dim=1)  # (L, P+T)
        steps = plan.cycle(cycle, acc.process_index)
        if cfg.log_completions and writer is not None:
            empty = share.empty.tolist() if share.empty is not None else [False] * len(rows.prompts)
            keep = [i for i in range(len(rows.prompts)) if not empty[i]]
            self._log_completions(
                writer, step_number, [rows.prompts[i] for i in keep], [rows.texts[i] for i in keep],
                rows.local_rewards[keep], advantages[keep],
            )

        rollout = Rollout(
            prompt_index=list(rows.prompt_index),
            input_ids=torch.cat([prompt_tensor, rows.completion_ids], dim=1),  # (L, P+T)
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logps=None,
            ref_logps=None,
            sampling_logps=rows.sampling_logps,
            window_items=self._window_items(loss_mask, steps),
            metrics=share.metrics,
            num_tokens=share.num_tokens,
            generate_seconds=rows.generate_seconds,
            reward_seconds=rows.reward_seconds,
            nonfinite=share.nonfinite or nonfinite,
            next_prompt=share.next_prompt,
            prompt_source=rows.prompt_source,
        )
        with self.guard.phase("log-probs", step_number):
            if not (self.plan.on_policy and self.config.beta == 0.0):
                phase(f"log-probs step {step_number}")
            self._add_logps(rollout, steps)
        if self.ahead is not None and self.ahead.covers(first_prompt):
            self.ahead.done()  # kept until now: a checkpoint of this cycle's start holds it
        return rollout

    def start_ahead(self, first_prompt: int) -> None:
        """Start generating the cycle whose prompts start at ``first_prompt`` beside the
        training pass (``generate_ahead``; nothing if it is pending already, after a resume)."""
        if self.ahead is None or self.ahead.covers(first_prompt):
            return
        indices = self._plain_indices(first_prompt)
        self.ahead.start(first_prompt, indices, *self.prompts.prompts_for(indices))

    def wait_ahead(self) -> None:
        """Wait for the generation started by :meth:`start_ahead` (if any) to finish."""
        if self.ahead is not None:
            self.ahead.wait()

    def generate_round(self, indices: list[int], step_number: int) -> Round:
        """Generate and score one episode per entry of ``indices`` (this process's rows)."""
        acc = self.accelerator
        prompts, prompt_ids, columns = self.prompts.prompts_for(indices)
        pending = self.ahead.take(indices) if self.ahead is not None else None
        if pending is not None:  # generated beside the last cycle's training
            episodes, generate_seconds = pending.episodes, pending.seconds
        else:
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
        columns = with_info(columns, episodes.info, self.prompts.prompt_column)

        phase(f"scoring step {step_number}")
        t0 = time.perf_counter()
        local_rewards, texts = self._score(prompts, completion_ids, model_mask, columns, step_number, episodes.completions)
        return Round(
            prompt_index=list(indices), prompt_ids=prompt_ids, prompts=prompts, completion_ids=completion_ids,
            completion_mask=completion_mask, model_mask=model_mask, truncated=truncated,
            sampling_logps=self._sampling_logps(episodes), local_rewards=local_rewards, texts=texts,
            generate_seconds=generate_seconds, reward_seconds=time.perf_counter() - t0,
            episode_metrics=self._episode_metrics(episodes.stats, completion_mask, model_mask),
        )

    def _plain_share(self, first_prompt: int, step_number: int) -> Share:
        """The cycle's batch as generated: one round of ``unique_prompts`` prompts."""
        acc, plan = self.accelerator, self.plan
        G = plan.num_generations
        r = self.generate_round(self._plain_indices(first_prompt), step_number)
        all_rewards = acc.gather(r.local_rewards)  # (N, K) N = L * num_processes, process order
        lengths = r.model_mask.sum(1)  # (L,) model tokens
        local_tokens = sum(len(p) for p in r.prompt_ids) + r.completion_mask.sum()
        return Share(
            rows=r,
            all_rewards=all_rewards,
            metrics={
                **reward_metrics(all_rewards, self.rewards.names, self.rewards.weights, G),
                **completion_metrics(acc.gather(lengths), acc.gather(r.truncated.long()).bool()),
                **r.episode_metrics,
            },
            num_tokens=int(acc.reduce(torch.as_tensor(local_tokens, device=acc.device).double(), reduction="sum")),
            next_prompt=first_prompt + plan.unique_prompts,
        )

    def _plain_indices(self, first_prompt: int) -> list[int]:
        """This process's prompt rows of the cycle whose prompts start at ``first_prompt``."""
        plan, G = self.plan, self.plan.num_generations
        return [first_prompt + c // G for c in range(plan.effective_batch_size)][plan.process_rows(self.accelerator.process_index)]

    # -- the stages ----------------------------------------------------------------------------

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
        """(L, K) rewards of this process's episodes, and what the rewards saw as completions. A
        failure on any process raises RewardFailed on every process."""
        from grpo_plugins.rewards import RewardError

        acc = self.accelerator
        error: Exception | None = None
        try:
            local, texts = score_episodes(
                self.tokenizer, self.rewards, prompts, completion_ids, model_mask, columns, step_number - 1, completions
            )
            local = local.to(acc.device)  # (L, K)
        except RewardError as exc:
            error, texts = exc, []
            local = torch.zeros(len(prompts), len(self.rewards.names), device=acc.device)
        # Every process takes part in the check (a collective), whether its rewards failed or not.
        raise_if_any_failed(acc if acc.num_processes > 1 else None, error)
        return local, texts

    def _advantages(self, all_rewards: Tensor, step_number: int) -> tuple[Tensor, str | None]:
        """This process's (L,) advantages, computed over the whole gathered (N, K) reward table."""
        acc, L = self.accelerator, self.plan.completions_per_process
        advantages_all = self.advantages_of(all_rewards.double()).float()  # (N,)
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

        cfg = self.config
        T = rollout.loss_mask.shape[1]
        out = torch.zeros_like(rollout.loss_mask)  # (L, T)
        with torch.no_grad(), self.accelerator.autocast(), self.policy.layers():
            for step in steps[: self.plan.steps_per_generation]:
                # The training step's own passes, so each row sees the same input in both.
                passes = plan_passes(
                    rollout.input_ids[step.rows], rollout.attention_mask[step.rows], T, self.policy.multiple,
                    cfg.train_chunk_rows, split=groups_by_length(cfg), min_pass_tokens=self.policy.min_pass_tokens,
                    max_pass_tokens=self.policy.pass_tokens(),
                )
                rows = out[step.rows]  # (B, T) view
                sources = rollout.input_prompts()[step.rows]
                for c in passes.chunks:
                    ids, att, w = passes.pass_inputs(c, self.policy.multiple)
                    logps, _ = completion_logps(
                        model, ids, att, w, temperature=cfg.temperature,
                        chunk_size=cfg.logprob_chunk_size, chunk_fn=self.policy.chunk_fn,
                        inputs=self.policy.image_inputs(passes.rows_of(sources, c), ids, w),
                        one_run=passes.one_run(c),
                    )  # (b, w)
                    where = c if passes.order is None else passes.order[c]
                    rows[where, :w] = logps.float()
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
