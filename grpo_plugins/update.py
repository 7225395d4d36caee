"""The policy update: micro-steps (forward + backward with accumulation) and optimizer steps.

:class:`PolicyUpdate` runs one micro-step of the plan on a :class:`~grpo_plugins.rollout_batches.Rollout`
(``train_chunk_rows`` rows per forward+backward, DDP gradient sync only on the backward that
ends an accumulation window), collects the loss and metrics of the window in an
:class:`AccumulationWindow`, and at the window's end clips the gradient norm, steps the
optimizer and the scheduler, and returns the step's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.batching import BatchPlan, Step
from grpo_plugins.compiled_layers import compile_stats
from grpo_plugins.config import GRPOConfig
from grpo_plugins.guards import RunGuard
from grpo_plugins.objective import BONUS_ENTROPY, LossMetrics, Objective
from grpo_plugins.precision import MasterWeights
from grpo_plugins.policy import Policy, groups_by_length, plan_passes
from grpo_plugins.rollout_batches import Rollout


@dataclass
class AccumulationWindow:
    """What the micro-steps of one accumulation window produced, until its optimizer step."""

    losses: list[Tensor] = field(default_factory=list)  # one 0-d loss per micro-step
    metrics: list[LossMetrics] = field(default_factory=list)
    entropy_sum: float | Tensor = 0.0  # over the active tokens of the window (this process)
    entropy_count: float | Tensor = 0.0

    def add(self, loss: Tensor, metrics: LossMetrics, entropy_sum: Tensor, entropy_count: Tensor) -> None:
        self.losses.append(loss)
        self.metrics.append(metrics)
        self.entropy_sum = entropy_sum + self.entropy_sum
        self.entropy_count = entropy_count + self.entropy_count


class EntropyControl:
    """The entropy bonus's coefficient (``entropy_coef``), and Skywork-OR1's adaptive control of
    it (``use_adaptive_entropy``), exactly as TRL 1.16 runs it.

    Every micro-step of an optimizer step applies :meth:`coefficient`: ``entropy_coef``, or with
    adaptive control ``entropy_coef`` only while the last step's entropy was at or below
    ``entropy_target`` (0 otherwise; the first step sees +inf, so 0). After the optimizer step,
    :meth:`update` moves the coefficient by ``entropy_coef_delta`` towards more bonus when the
    step's entropy (over the tokens the bonus acts on, all processes) was at or below the target
    and towards less otherwise, clamped to [entropy_coef_min, entropy_coef_max].
    """

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.coef = float(config.entropy_coef)
        self.last_entropy = float("inf")

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.config.use_adaptive_entropy

    def coefficient(self) -> float:
        if not self.config.use_adaptive_entropy:
            return self.coef
        return self.coef if self.last_entropy <= self.config.entropy_target else 0.0

    def update(self, entropy: float) -> None:
        cfg = self.config
        if not cfg.use_adaptive_entropy:
            return
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])


class PolicyUpdate:
    """Micro-steps and optimizer steps of one run.

    Args:
        config: the run config.
        accelerator: the run's ``accelerate.Accelerator``.
        plan: the batch plan.
        policy: the model being trained.
        trainable: its trainable parameters (what the gradient norm is clipped over).
        optimizer: the accelerate-prepared optimizer.
        scheduler: the learning-rate scheduler (stepped once per optimizer step).
        objective: the loss settings, components built (:meth:`Objective.from_config`).
        guard: the run's guard (NaN/inf checks of loss and gradients).
        master: float32 master copies of 16-bit trainable weights, which the optimizer steps
            instead of them (``precision``), or None.
    """

    def __init__(
        self,
        config: GRPOConfig,
        accelerator: Any,
        plan: BatchPlan,
        policy: Policy,
        trainable: list[torch.nn.Parameter],
        optimizer: Any,
        scheduler: Any,
        objective: Objective,
        guard: RunGuard,
        master: MasterWeights | None = None,
    ) -> None:
        self.config, self.accelerator, self.plan, self.policy = config, accelerator, plan, policy
        self.trainable, self.optimizer, self.scheduler = trainable, optimizer, scheduler
        self.objective, self.guard, self.master = objective, guard, master
        self.entropy = EntropyControl(config)

    def micro_step(self, rollout: Rollout, step: Step, window_items: float, window: AccumulationWindow) -> None:
        """Forward+backward of one micro-step, ``train_chunk_rows`` rows at a time (the gradient,
        loss and metrics equal those of the whole micro-batch at once; see row_chunks), added to
        ``window``."""
        from grpo_plugins.logprobs import completion_logps
        from grpo_plugins.objective import compute_loss
        from grpo_plugins.row_chunks import ChunkedReduction

        acc, cfg, policy = self.accelerator, self.config, self.policy
        r = step.rows
        passes = plan_passes(
            rollout.input_ids[r], rollout.attention_mask[r], rollout.loss_mask.shape[1], policy.multiple,
            cfg.train_chunk_rows, split=groups_by_length(cfg), min_pass_tokens=policy.min_pass_tokens,
            max_pass_tokens=policy.pass_tokens(),
        )
        t, chunks = passes.t, passes.chunks
        sources = rollout.input_prompts()[r]
        mask = passes.in_pass_order(rollout.loss_mask[r, :t])  # (B, t)
        advantages = passes.in_pass_order(rollout.advantages[r])  # (B,)

        def cut(x: Tensor | None, c: slice, width: int) -> Tensor | None:
            return None if x is None else passes.in_pass_order(x[r, :t])[c, :width]

        losses: list[Tensor] = []
        metrics: list[LossMetrics] = []
        ent_sum = torch.zeros((), device=acc.device)
        coef = self.entropy.coefficient()
        objective = self.objective
        if coef != objective.entropy_coef:  # adaptive entropy control's coefficient of this step
            objective = dataclasses.replace(objective, entropy_coef=coef)
        # The entropy bonus needs the entropy's gradient; otherwise it is a (detached) metric.
        with_entropy: bool | str = "grad" if coef != 0.0 else True
        wants_entropies = self.entropy.enabled or cfg.top_entropy_quantile < 1.0
        for i, c in enumerate(chunks):
            # DDP syncs gradients once, on the backward that ends the accumulation window.
            last = i == len(chunks) - 1
            sync = contextlib.nullcontext() if step.optimizer_update and last else acc.no_sync(policy.model)
            chunk_ids, chunk_att, w = passes.pass_inputs(c, policy.multiple)
            chunk_objective = objective
            if len(chunks) > 1:
                chunk_objective = dataclasses.replace(
                    objective, loss_type=ChunkedReduction(objective.loss_type, mask, advantages, c)
                )
            chunk_mask = mask[c, :w]  # (b, w)
            # Backward inside layers() too: activation checkpointing recomputes the layers then.
            with sync, policy.layers():
                with acc.autocast():
                    logps, entropy = completion_logps(
                        policy.model, chunk_ids, chunk_att, w, temperature=cfg.temperature,
                        chunk_size=cfg.logprob_chunk_size, with_entropy=with_entropy, chunk_fn=policy.chunk_fn,
                        inputs=policy.image_inputs(passes.rows_of(sources, c), chunk_ids, w),
                        one_run=passes.one_run(c),
                    )  # (b, w) (b, w)
                    pool = self._entropy_pool(entropy, chunk_mask) if cfg.top_entropy_quantile < 1.0 else None
                    loss, chunk_metrics = compute_loss(
                        logps,
                        cut(rollout.old_logps, c, w),
                        advantages[c],
                        chunk_mask,
                        ref_per_token_logps=cut(rollout.ref_logps, c, w),
                        sampling_per_token_logps=cut(rollout.sampling_logps, c, w),
                        num_items_in_batch=window_items,
                        num_processes=acc.num_processes,
                        gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
                        entropies=entropy if wants_entropies else None,
                        entropy_pool=pool,
                        objective=chunk_objective,
                    )
                acc.backward(loss)
            assert entropy is not None
            with torch.no_grad():
                ent_sum = ent_sum + (entropy.detach().float() * chunk_mask).sum()
            losses.append(loss.detach().float())
            metrics.append(chunk_metrics)
        merged = metrics[0] if len(metrics) == 1 else LossMetrics.merge(metrics)
        window.add(torch.stack(losses).sum(), merged, ent_sum, mask.sum())

    def _entropy_pool(self, entropy: Tensor | None, mask: Tensor) -> Tensor | None:
        """The active tokens' entropies of every process (top_entropy_quantile's threshold is
        taken over them, as in TRL); None on one process (compute_loss uses its own)."""
        acc = self.accelerator
        if acc.num_processes <= 1 or entropy is None:
            return None
        local = entropy.detach().float()[mask != 0]  # (n,)
        sentinel = -1e9  # entropies are never negative
        padded = acc.pad_across_processes(local, dim=0, pad_index=sentinel)
        gathered = acc.gather(padded)
        return gathered[gathered != sentinel]

    def optimizer_step(
        self, rollout: Rollout, window: AccumulationWindow, window_items: float, step_number: int
    ) -> dict[str, float]:
        """Clip, step the optimizer and the scheduler for ``window``; returns the step's metrics
        (the rollout's reward and completion statistics, the loss metrics, loss, grad_norm,
        learning_rate, entropy, nonfinite_skipped)."""
        acc, cfg = self.accelerator, self.config
        local_loss = torch.stack(window.losses).sum()
        step_loss = acc.reduce(local_loss.reshape(1), reduction="mean")  # NaN/inf if any process's is
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        if self.master is not None:
            self.master.grads_to_masters()
        stepped = self.master.params if self.master is not None else self.trainable
        grad_norm = acc.clip_grad_norm_(stepped, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        grad_norm_value = float(grad_norm) if grad_norm is not None else 0.0
        lr = self.scheduler.get_last_lr()[0]
        names = [name for name, p in self.policy.unwrapped.named_parameters() if p.requires_grad]
        grads = ((name, p.grad) for name, p in zip(names, stepped))
        nonfinite = self.guard.check_update(
            step_number, float(step_loss), grad_norm_value, grads, rollout.nonfinite, loss_scaling=acc.scaler is not None
        )
        # No active token in the whole window (e.g. all completions truncated and masked): the
        # gradient is exactly zero and the parameters must not move, so AdamW does not step.
        hold = nonfinite or window_items == 0
        if hold:
            self.optimizer.zero_grad(set_to_none=True)
        scale_before = float(acc.scaler.get_scale()) if acc.scaler is not None else 0.0
        if not hold or acc.scaler is not None:
            # float16: step even when holding (no gradients, so nothing moves) so that the
            # gradient scaler's unscale/update cycle completes; the next step would fail otherwise.
            self.optimizer.step()
            if self.master is not None:
                self.master.masters_to_params()
        with warnings.catch_warnings():  # the optimizer may have skipped this step on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_grad()

        merged = LossMetrics.merge(window.metrics).all_reduce(acc)
        if self.entropy.enabled and BONUS_ENTROPY in merged.mean_names:
            self.entropy.update(float(merged[BONUS_ENTROPY]))  # the window's entropy, all processes
        counts = torch.stack([torch.as_tensor(window.entropy_sum), torch.as_tensor(window.entropy_count)])
        entropy = acc.reduce(counts.to(acc.device).double(), reduction="sum")
        record: dict[str, float] = dict(rollout.metrics)
        record.update({k: float(v) for k, v in merged.items()})
        record.update(compile_stats())
        record.update(
            {
                "loss": float(step_loss) if math.isfinite(float(step_loss)) else 0.0,
                "grad_norm": grad_norm_value if math.isfinite(grad_norm_value) else 0.0,
                "learning_rate": float(lr),
                "entropy": float(entropy[0] / entropy[1].clamp(min=1)),
                "nonfinite_skipped": 1.0 if nonfinite else 0.0,
            }
        )
        if self.entropy.enabled:
            record["entropy_coef"] = self.entropy.coef  # after this step's update, as TRL logs it
        if acc.scaler is not None:  # float16: the scaler skips steps whose gradients overflowed
            record["loss_scale"] = float(acc.scaler.get_scale())
            # The scaler lowers its scale exactly when it found inf/NaN gradients and skipped the
            # update. (accelerate's ``step_was_skipped`` reads False with the fused AdamW, which
            # is always called and skips inside its kernel: seen on the H200.)
            record["scaler_skipped"] = 1.0 if record["loss_scale"] < scale_before else 0.0
        return record


def trainable_parameters(model: Any, dtype: str) -> list[torch.nn.Parameter]:
    """The parameters that train (float16 runs keep them in fp32, under autocast and a gradient
    scaler)."""
    from grpo_plugins.errors import TrainingError

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise TrainingError("the model has no trainable parameters (all have requires_grad=False)")
    if dtype == "float16":
        for p in trainable:
            p.data = p.data.float()
    return trainable


def master_weights_for(trainable: list[torch.nn.Parameter], wanted: bool | None) -> MasterWeights | None:
    """float32 master copies of 16-bit trainable weights (``master_weights``: None means
    whenever they are 16-bit), or None."""
    from grpo_plugins.precision import needs_master_weights

    if wanted is False or not needs_master_weights(trainable):
        return None
    return MasterWeights(trainable)


def make_optimizer(
    trainable: list[torch.Tensor], config: GRPOConfig, device: torch.device, *, fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW over ``trainable`` (or their master copies); weight decay only on matrices (not
    biases or norms). ``fused``: the fused kernel on CUDA; False for FSDP's sharded (DTensor)
    parameters, which take the multi-tensor path."""
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # On CUDA the fused kernel: one launch per step and no parameter-sized temporaries (the
    # default multi-tensor path allocates some, which set the peak memory of a small model).
    return torch.optim.AdamW(
        groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
        fused=True if fused and device.type == "cuda" else None,
    )


def make_scheduler(config: GRPOConfig, optimizer: Any, total_steps: int) -> Any:
    """The learning-rate schedule of ``config`` over ``total_steps`` optimizer steps (not
    prepared by accelerate, which would step it once per process)."""
    from transformers import get_scheduler

    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)
    kwargs: dict[str, Any] = {}
    if config.lr_scheduler_type == "cosine_with_min_lr":
        kwargs["scheduler_specific_kwargs"] = {"min_lr_rate": 0.1}
    return get_scheduler(
        config.lr_scheduler_type,
        optimizer=optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        **kwargs,
    )
