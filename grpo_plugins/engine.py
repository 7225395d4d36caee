"""The GRPO training loop on accelerate (docs/engine.md), read as a recipe: setup, the loop, save.

One implementation behind two entry points: ``run_training(config)`` (the ``grpo-plugins
train`` command) and ``Engine(config, model=..., tokenizer=..., rewards=[...], dataset=...)``
for people coming from TRL or Unsloth who already hold a model, reward functions and data.

Setup is one call, :func:`~grpo_plugins.run_parts.build_run_parts`, which returns every part of
the run built (``run_parts.py``). Each *generation cycle* follows the
:class:`~grpo_plugins.batching.BatchPlan` exactly:

1. :class:`~grpo_plugins.rollout.RolloutMaker` generates this process's share of the batch,
   scores it, computes the advantages over the whole gathered batch and the old/reference
   log-probs that the cycle needs (``rollout.py``);
2. :class:`~grpo_plugins.update.PolicyUpdate` runs the planned micro-steps with gradient
   accumulation and the optimizer steps (``update.py``);
3. :class:`~grpo_plugins.step_log.StepLog` times the steps and writes their metrics, and the
   engine checkpoints at the configured interval (``resume.py``, one call to save and one to
   resume).

The same script runs on a CPU, one GPU, or several processes under ``accelerate launch`` /
``torchrun`` (DDP, or FSDP with ``fsdp:``: ``sharding.py``; gloo on CPUs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_plugins import sharding
from grpo_plugins.batching import Step
from grpo_plugins.checkpoint import capture_rng, write_atomic
from grpo_plugins.config import GRPOConfig, load_config
from grpo_plugins.console import GracefulStop, RunConsole, phase
from grpo_plugins.errors import TrainingError
from grpo_plugins.guards import NonFiniteError
from grpo_plugins.heap import LongLivedObjects
from grpo_plugins.metrics import MetricsWriter
from grpo_plugins.registry import Registry, registry_for
from grpo_plugins.resume import Position, resume_point, resume_run, save_run
from grpo_plugins.rollout import accumulation_windows
from grpo_plugins.rollout_batches import Rollout
from grpo_plugins.run_parts import Given, RunParts, build_run_parts
from grpo_plugins.scoring import RewardFailed
from grpo_plugins.step_log import StepLog
from grpo_plugins.update import AccumulationWindow

__all__ = ["Engine", "NonFiniteError", "TrainResult", "TrainingError", "TrainingInterrupted", "run_training"]


@dataclass
class TrainResult:
    """What a finished run leaves behind.

    Attributes:
        output_dir: the run's output directory.
        global_step: optimizer steps taken (including those before a resume).
        metrics: the last logged metrics.
        checkpoint: the final checkpoint directory (None on non-main processes).
        history: every metrics record this run logged (main process).
        evals: every evaluation this run made (``eval_strategy: steps``), with its ``step``.
    """

    output_dir: Path
    global_step: int
    metrics: dict[str, float]
    checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run.

    Attributes:
        step: optimizer steps done.
        checkpoint: the checkpoint to resume from (saved at the interruption when it could be
            saved exactly, else the last one), or None when there is none.
        saved_now: whether ``checkpoint`` was saved at the interruption.
    """

    def __init__(self, step: int, checkpoint: Path | None, saved_now: bool) -> None:
        super().__init__(step, checkpoint)
        self.step, self.checkpoint, self.saved_now = step, checkpoint, saved_now


class Engine:
    """Trains a policy with GRPO.

    Args:
        config: a :class:`GRPOConfig`, a mapping of config keys, or a YAML file.
        model: an already-loaded causal LM or image-text-to-text model (transformers,
            optionally peft); default: load ``config.model``. LoRA (``config.lora``) is applied to
            it unless it is already a peft model.
        tokenizer: its tokenizer, or a vision-language model's processor (required with
            ``model``).
        rewards: reward callables (TRL contract: ``fn(prompts, completions, completion_ids=...,
            **columns) -> list[float | None]``, plain or async); default: ``config.rewards`` or
            the task's default rewards.
        dataset: a ``datasets.Dataset`` (or a list of row dicts) with a prompt column; default:
            ``config.dataset`` or the task's data.
        eval_dataset: prompts to evaluate on every ``eval_steps`` (with ``eval_strategy:
            steps``); default: ``config.eval_dataset``, or the task's held-out split when training
            on the task's data.
        environment: an already built environment (e.g. ``ToolCalling(functions=[my_tool])``);
            default: ``config.environment``.
        registry: where components are looked up (default: the process-wide registry, or one
            without ``config.disable_plugins``).

    Attributes:
        parts: the run's parts (:class:`~grpo_plugins.run_parts.RunParts`), there from setup
            (inside :meth:`train`) on; each part, and each of the trained model's
            (``engine.unwrapped``, ``engine.optimizer``, ``engine.master``, ...), reads as an
            attribute of the engine too.
        global_step: optimizer steps done.
        trace: one record per micro-step consumed (cycle, step, prompt indices of its rows,
            optimizer_update), to compare with ``make_plan(...).cycle(c)``.
        evals: every evaluation this run made, with its ``step``.
    """

    #: Parts of :class:`RunParts`, and of its trained model, that read as the engine's own.
    _PARTS = frozenset({
        "accelerator", "plan", "scheduler", "generator", "environment", "dataset", "prompt_column", "task",
        "rewards", "guard", "total_steps", "rollouts", "update", "evaluator", "eval_every",
    })
    _POLICY = frozenset({
        "model", "unwrapped", "tokenizer", "ref_model", "is_peft", "trainable", "master", "optimizer", "compiled_layers",
    })

    def __init__(
        self,
        config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        model: Any = None,
        tokenizer: Any = None,
        rewards: Sequence[Callable[..., Any]] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        environment: Any = None,
        registry: Registry | None = None,
    ) -> None:
        self.config = config if isinstance(config, GRPOConfig) else load_config(config)
        if model is not None and tokenizer is None:
            raise TrainingError("Engine(model=...) needs the model's tokenizer too: pass tokenizer=...")
        self.registry = registry if registry is not None else registry_for(self.config.disable_plugins)
        if model is None and rewards is None and dataset is None and environment is None:
            # The config-only path gets the same complete check as `grpo-plugins validate`.
            from grpo_plugins.validation import validate_config

            validate_config(self.config, self.registry)
        self.given = Given(
            model=model, tokenizer=tokenizer, rewards=list(rewards) if rewards is not None else None,
            dataset=dataset, eval_dataset=eval_dataset, environment=environment,
        )
        self.output_dir = Path(self.config.output_dir)
        # The run's progress:
        self.global_step = 0
        self.num_tokens = 0
        self.next_prompt = 0  # the prompt stream's position: the first prompt of the next rollout
        self.trace: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self.heap = LongLivedObjects()  # keeps full garbage collections out of the steps (heap.py)
        self.console = RunConsole(enabled=os.environ.get("RANK", "0") == "0")
        self.stop = GracefulStop(self.console)  # Ctrl-C during training: finish the step, save

    def __getattr__(self, name: str) -> Any:
        parts = self.__dict__.get("parts")
        if parts is not None and name in Engine._PARTS:
            return getattr(parts, name)
        if parts is not None and name in Engine._POLICY:
            return getattr(parts.policy, name)
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}" + (
            " before setup (train() sets the run up)" if name in Engine._PARTS | Engine._POLICY else ""
        ))

    # -- public --------------------------------------------------------------------------------

    def train(self, resume: str | os.PathLike[str] | bool | None = None) -> TrainResult:
        """Run the training to its end (``max_steps`` or ``num_train_epochs``).

        Args:
            resume: True continues from the latest checkpoint in ``output_dir``; a path
                continues from that checkpoint (or the latest in that output directory).

        Raises:
            RewardError: a reward failed; the last completed step was saved first.
            NonFiniteError: a NaN/inf loss or gradient with ``on_nonfinite: stop``.
        """
        # Before the model loads: a wrong resume path or an earlier run in output_dir fails fast.
        resume_from = resume_point(resume, self.output_dir)
        with self.console, self.stop.installed():
            phase("loading model")
            self._setup()
            try:
                return self._run(resume_from)
            finally:
                self._teardown()

    # -- setup and cleanup ----------------------------------------------------------------------

    def _setup(self) -> None:
        self.parts: RunParts = build_run_parts(self.config, self.registry, self.given)
        self.console.compiling = self.parts.compiles

    def _teardown(self) -> None:
        self.parts.save_compiled()  # e.g. the decode graphs of a final evaluation
        self.parts.close()
        self.heap.release()

    # -- the loop ------------------------------------------------------------------------------

    def _run(self, resume_from: Path | None) -> TrainResult:
        cfg, parts = self.config, self.parts
        acc, plan, guard, update = parts.accelerator, parts.plan, parts.guard, parts.update
        at = resume_run(resume_from, parts, cfg) if resume_from is not None else Position()
        self.global_step, self.num_tokens, self.next_prompt = at.global_step, at.num_tokens, at.next_prompt
        cycle, start_k, rollout = at.cycle, at.next_micro_step, at.rollout
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.output_dir / "config.yaml", cfg.to_yaml())
        writer = MetricsWriter(
            self.output_dir, list(cfg.report_to), parts.total_steps, self.global_step, enabled=acc.is_main_process,
            console=self.console,
        )
        log = StepLog(writer, cfg.logging_steps, parts.total_steps, acc.device, list(at.log_window))
        try:
            if parts.evaluator is not None and cfg.eval_on_start and self.global_step == 0:
                try:
                    self._evaluate(writer)
                except RewardFailed as failed:
                    raise failed.error from None
            last_saved = self.global_step if resume_from is not None else -1
            final: Path | None = None
            self.heap.freeze()  # the model, data and plugins stay alive to the end
            first_cycle = cycle
            while self.global_step < parts.total_steps:
                steps = plan.cycle(cycle, acc.process_index)
                if rollout is None:
                    rollout = self._next_rollout(cycle, log, saved=last_saved == self.global_step)
                if self.global_step + sum(s.optimizer_update for s in steps[start_k:]) < parts.total_steps:
                    parts.rollouts.start_ahead(rollout.next_prompt)  # with generate_ahead: beside this cycle's training
                windows = accumulation_windows(steps)
                window = AccumulationWindow()
                log.start_cycle()
                self.stop.training_now = True
                for k in range(start_k, len(steps)):
                    step, items = steps[k], rollout.window_items[windows[k]]
                    phase(f"training step {self.global_step + 1}")
                    with log.training(), guard.phase("training", self.global_step + 1):
                        update.micro_step(rollout, step, items, window)
                    self._trace(cycle, step, rollout)
                    if not step.optimizer_update:
                        continue
                    with guard.phase("generation", self.global_step + sum(s.optimizer_update for s in steps[k:]) + 1):
                        parts.rollouts.wait_ahead()  # the next batch sampled these weights: done before they change
                    with log.training(), guard.phase("training", self.global_step + 1):
                        record = self._optimizer_step(rollout, window, items)
                    window = AccumulationWindow()
                    log.step(self.global_step, record, self.num_tokens)
                    parts.save_compiled()
                    done = self.global_step >= parts.total_steps
                    # Where a checkpoint taken now resumes: this cycle's next micro-step, or the next cycle.
                    resume_at = (cycle, k + 1, rollout) if k + 1 < len(steps) else (cycle + 1, 0, None)
                    if parts.evaluator is not None and self.global_step % parts.eval_every == 0:
                        try:
                            self._evaluate(writer)
                        except RewardFailed as failed:
                            # The step is done: keep it (as a failing reward in a rollout does).
                            if self.global_step != last_saved:
                                self._save(*resume_at, log)
                            raise failed.error from None
                    if done or (cfg.save_steps and self.global_step % cfg.save_steps == 0):
                        final = self._save(*resume_at, log)
                        last_saved = self.global_step
                    if done:
                        break
                    if self.stop.requested:  # Ctrl-C: between optimizer steps, a checkpoint resumes exactly
                        self.stop.training_now = False
                        if last_saved != self.global_step:
                            self._save(*resume_at, log)
                        raise TrainingInterrupted(self.global_step, guard.last_checkpoint, saved_now=True)
                self.stop.training_now = False
                cycle, start_k, rollout = cycle + 1, 0, None
                if cycle == first_cycle + 1 and self.global_step < parts.total_steps:
                    self.heap.freeze()  # and so do the graphs the first cycle compiled (not its rollout)
        finally:
            writer.close()
        if final is None and last_saved == self.global_step and resume_from is not None:
            final = resume_from  # resumed a finished run: nothing left to do
        return TrainResult(
            output_dir=self.output_dir,
            global_step=self.global_step,
            metrics=log.last_logged,
            checkpoint=final if acc.is_main_process else None,
            history=log.history,
            evals=self.evals,
        )

    def _evaluate(self, writer: MetricsWriter) -> None:
        """Evaluate the policy now and log ``eval/...`` metrics at the current step (training's
        random streams and the generator's state are left as they were)."""
        evaluator = self.parts.evaluator
        if evaluator is None:
            raise TrainingError("this run evaluates nothing: set eval_strategy: steps")
        phase(f"evaluating at step {self.global_step}")
        with self.parts.guard.phase("evaluation", self.global_step), self._full_weights():
            result = evaluator.run(step=self.global_step, model=f"step {self.global_step}")
        metrics = result.metrics()
        writer.log_eval(self.global_step, metrics)
        self.evals.append({"step": self.global_step, **metrics})

    def _next_rollout(self, cycle: int, log: StepLog, saved: bool) -> Rollout:
        """The rollout of ``cycle``; a failing reward or a NaN/inf with on_nonfinite: stop ends the
        run between cycles, after saving the progress made (unless ``saved`` already)."""
        parts = self.parts
        generator = parts.generator
        rng_at_cycle_start = capture_rng()
        generator_at_cycle_start = generator.state_dict() if hasattr(generator, "state_dict") else None
        t0 = time.perf_counter()
        try:
            with parts.guard.phase("generation", self.global_step + 1), self._full_weights():
                rollout = parts.rollouts.make(cycle, self.global_step + 1, log.writer, self.next_prompt)
        except (RewardFailed, NonFiniteError) as failed:
            if self.global_step > 0 and not saved:
                self._save(cycle, 0, None, log, rng_at_cycle_start)
            raise getattr(failed, "error", failed) from None
        except KeyboardInterrupt:
            # Nothing of this cycle is trained yet: its start is an exact place to resume from.
            saved_now = self.global_step > 0 and not saved and parts.accelerator.num_processes == 1
            if saved_now:
                if generator_at_cycle_start is not None:  # its call counter seeds the next generation
                    generator.load_state_dict(generator_at_cycle_start)
                self._save(cycle, 0, None, log, rng_at_cycle_start)
            raise TrainingInterrupted(self.global_step, parts.guard.last_checkpoint, saved_now) from None
        log.rollout_done(rollout, time.perf_counter() - t0)
        self.num_tokens += rollout.num_tokens
        self.next_prompt = rollout.next_prompt
        return rollout

    def _full_weights(self) -> Any:
        """FSDP: the policy's and the reference's full weights for the block (generation and the
        log-prob passes decode with them on each process alone); otherwise nothing."""
        return sharding.gathered(self.parts.policy.unwrapped, self.parts.policy.ref_model)

    def _optimizer_step(self, rollout: Rollout, window: AccumulationWindow, window_items: float) -> dict[str, float]:
        parts = self.parts
        record = parts.update.optimizer_step(rollout, window, window_items, self.global_step + 1)
        self.global_step += 1
        cfg, policy = self.config, parts.policy
        if cfg.sync_ref_model and policy.ref_model is not None and self.global_step % cfg.ref_model_sync_steps == 0:
            sync_reference(policy.ref_model, policy.unwrapped, cfg.ref_model_mixup_alpha)
        parts.generator.on_weights_updated(policy.unwrapped)
        return record

    def _trace(self, cycle: int, step: Step, rollout: Rollout) -> None:
        batch = rollout.prompt_index[step.rows]
        process = self.parts.accelerator.process_index
        self.trace.append(dict(cycle=cycle, step=step.step, batch=batch, optimizer_update=step.optimizer_update, process=process))

    def _save(
        self, cycle: int, next_micro_step: int, rollout: Rollout | None, log: StepLog, rng: dict[str, Any] | None = None
    ) -> Path:
        """Checkpoint the run; it resumes at micro-step ``next_micro_step`` of ``cycle`` (with
        ``rollout`` when that is mid-cycle) and with the RNG state ``rng`` (default: now's)."""
        phase(f"saving checkpoint {self.global_step}")
        at = Position(self.global_step, self.num_tokens, self.next_prompt, cycle, next_micro_step, rollout, log.window)
        return save_run(self.parts, self.config, self.output_dir, at, rng)


def sync_reference(ref_model: Any, policy: Any, alpha: float) -> None:
    """TR-DPO's reference update (``sync_ref_model``): ref = alpha * policy + (1 - alpha) * ref,
    parameter by parameter (TRL's SyncRefModelCallback)."""
    with torch.no_grad():
        for ref_p, p in zip(ref_model.parameters(), policy.parameters(), strict=True):
            ref_p.mul_(1.0 - alpha).add_(p.detach().to(ref_p.dtype), alpha=alpha)


def run_training(
    config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    resume: str | os.PathLike[str] | bool | None = None,
) -> TrainResult:
    """Train as ``config`` says (the ``grpo-plugins train`` command)."""
    return Engine(config).train(resume=resume)
