"""The GRPO training loop on accelerate (docs/engine.md), read as a recipe: setup, the loop, save.

One implementation behind two entry points: ``run_training(config)`` (the ``grpo-plugins
train`` command) and ``Engine(config, model=..., tokenizer=..., rewards=[...], dataset=...)``
for people coming from TRL or Unsloth who already hold a model, reward functions and data.

Each *generation cycle* follows the :class:`~grpo_plugins.batching.BatchPlan` exactly:

1. :class:`~grpo_plugins.rollout.RolloutMaker` generates this process's share of the batch,
   scores it, computes the advantages over the whole gathered batch and the old/reference
   log-probs that the cycle needs (``rollout.py``);
2. :class:`~grpo_plugins.update.PolicyUpdate` runs the planned micro-steps with gradient
   accumulation and the optimizer steps (``update.py``);
3. :class:`~grpo_plugins.step_log.StepLog` times the steps and writes their metrics, and the
   engine checkpoints at the configured interval (``checkpoint.py``).

The same script runs on a CPU, one GPU, or several processes under ``accelerate launch`` /
``torchrun`` (DDP, or FSDP with ``fsdp:``: ``sharding.py``; gloo on CPUs).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_plugins import sharding
from grpo_plugins.attention import training_passes
from grpo_plugins.batching import BatchPlan, Step
from grpo_plugins.checkpoint import (
    capture_rng, load_checkpoint, refuse_fresh_run_over, resolve_resume, restore_rng, save_checkpoint, write_atomic,
)
from grpo_plugins.compiled_layers import compiled_layers_for
from grpo_plugins.config import GRPOConfig, load_config
from grpo_plugins.console import RunConsole, phase
from grpo_plugins.episodes import build_environment
from grpo_plugins.errors import TrainingError
from grpo_plugins.evaluation import Evaluator
from grpo_plugins.generators import build_generator
from grpo_plugins.guards import NonFiniteError, RunGuard
from grpo_plugins.heap import LongLivedObjects
from grpo_plugins.metrics import MetricsWriter
from grpo_plugins.objective import Objective
from grpo_plugins.registry import Registry, registry_for, resolve_component
from grpo_plugins.rewards import reward_runner
from grpo_plugins.rollout import (
    Policy,
    RewardFailed,
    Rollout,
    RolloutMaker,
    accumulation_windows,
    corrects_rollouts,
    keeps_sampling_logps,
)
from grpo_plugins.runtime import make_accelerator
from grpo_plugins.step_log import StepLog
from grpo_plugins.precision import MasterWeights
from grpo_plugins.quantization import is_quantized
from grpo_plugins.update import (
    AccumulationWindow, PolicyUpdate, make_optimizer, make_scheduler, master_weights_for, trainable_parameters,
)

logger = logging.getLogger(__name__)

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
        model: an already-loaded causal LM (transformers, optionally peft); default: load
            ``config.model``. LoRA (``config.lora``) is applied to it unless it is already a
            peft model.
        tokenizer: its tokenizer (required with ``model``).
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
        trace: one record per micro-step consumed (cycle, step, prompt indices of its rows,
            optimizer_update), to compare with ``make_plan(...).cycle(c)``.
    """

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
        self._given_model = model
        self._given_tokenizer = tokenizer
        self._given_rewards = list(rewards) if rewards is not None else None
        self._given_dataset = dataset
        self._given_eval_dataset = eval_dataset
        self.evaluator: Evaluator | None = None
        self.eval_every = 0
        self.evals: list[dict[str, float]] = []
        self._given_environment = environment
        self.trace: list[dict[str, Any]] = []
        # Built by _setup():
        self.accelerator: Any = None
        self.plan: BatchPlan | None = None
        self.model: Any = None  # accelerate-prepared (DDP-wrapped on several processes)
        self.unwrapped: Any = None
        self.ref_model: Any = None
        self.tokenizer: Any = None
        self.is_peft = False
        self.trainable: list[torch.nn.Parameter] = []
        self.master: MasterWeights | None = None  # float32 copies the optimizer steps (16-bit weights)
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.compiled_layers: Any = None
        self.generator: Any = None
        self.environment: Any = None
        self.task: Any = None
        self.dataset: Any = None
        self.prompt_column = "prompt"
        self.rewards: Any = None
        self.guard: RunGuard | None = None
        self.total_steps = 0
        self.rollouts: RolloutMaker | None = None
        self.update: PolicyUpdate | None = None
        # The run's progress, set by _run():
        self.output_dir = Path(self.config.output_dir)
        self.global_step = 0
        self.num_tokens = 0
        self.next_prompt = 0  # the prompt stream's position: the first prompt of the next rollout
        self.writer: MetricsWriter | None = None
        self.log: StepLog | None = None
        self._own_process_group = False  # fsdp on one process: a group of one, ended at teardown
        self.heap = LongLivedObjects()  # keeps full garbage collections out of the steps (heap.py)
        self.console = RunConsole(enabled=os.environ.get("RANK", "0") == "0")
        # Ctrl-C during training finishes the optimizer step and saves (see _interrupt).
        self._training_now = False
        self._stop_requested = False

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
        resume_from = resolve_resume(resume, self.output_dir)
        if resume_from is None:
            refuse_fresh_run_over(self.output_dir)
        with self.console, self._ctrl_c():
            phase("loading model")
            self._setup()
            try:
                return self._run(resume_from)
            finally:
                self._teardown()

    @contextlib.contextmanager
    def _ctrl_c(self) -> Iterator[None]:
        """Route Ctrl-C through :meth:`_interrupt` (main thread, default handler only)."""
        # Several processes could catch one Ctrl-C in different phases and disagree on where to
        # save (a collective): they stop at once, as before.
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if several or threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        signal.signal(signal.SIGINT, self._interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _interrupt(self, signum: int, frame: Any) -> None:
        """Ctrl-C while a step trains: finish its optimizer step, save and stop (a checkpoint
        taken there resumes exactly). Anywhere else, or pressed again: stop at once."""
        if self._training_now and not self._stop_requested:
            self._stop_requested = True
            self.console.print(
                "Ctrl-C: saving a checkpoint when the optimizer step in progress ends (Ctrl-C again to stop at once)"
            )
            return
        raise KeyboardInterrupt

    # -- setup ---------------------------------------------------------------------------------

    def _setup(self) -> None:
        from accelerate.utils import set_seed

        cfg = self.config
        self.accelerator, self.plan = make_accelerator(cfg, self.registry)
        acc = self.accelerator
        if cfg.fsdp is not None:
            self._own_process_group = sharding.ensure_process_group(acc.device)
        set_seed(cfg.seed)
        self._load_model()
        self.generator = build_generator(cfg, self.registry, self.unwrapped, self.tokenizer, acc.device)
        from grpo_plugins.generators import generator_ref

        self.console.compiling = self.compiled_layers is not None or (
            generator_ref(cfg, cuda=acc.device.type == "cuda").name == "static"
        )
        self.environment = build_environment(cfg, self.registry, self.generator, self.tokenizer, self._given_environment)
        self._load_data()
        self.rewards = reward_runner(cfg, self.registry, self._given_rewards, self.task)
        self.guard = RunGuard(cfg, self.rewards.names, self.registry, self.generator.memory_advice)
        self.scheduler = make_scheduler(cfg, self.optimizer, self.total_steps)
        compiled = self.compiled_layers
        policy = Policy(
            self.model, self.unwrapped, self.ref_model, self.is_peft, functools.partial(training_passes, compiled),
            compiled.chunk_logps if compiled is not None else None,
            multiple=math.lcm(8 if compiled is not None else 1, cfg.pad_to_multiple_of or 1),
        )
        reg = self.registry
        self.rollouts = RolloutMaker(
            cfg, acc, self.plan, policy, self.tokenizer, self.dataset, self.prompt_column, self.environment,
            self.rewards, resolve_component("reward_scaling", cfg.scale_rewards, reg),
            corrects_rollouts(cfg.vllm_importance_sampling_correction, self.generator), self.guard, reg,
            group_filter=resolve_component("group_filter", cfg.group_filter, reg) if cfg.group_filter is not None else None,
            keep_sampling_logps=keeps_sampling_logps(cfg.vllm_importance_sampling_correction, self.generator),
        )
        self.update = PolicyUpdate(
            cfg, acc, self.plan, policy, self.trainable, self.optimizer, self.scheduler, Objective.from_config(cfg, reg),
            self.guard, self.master,
        )
        if cfg.eval_strategy == "steps":
            from grpo_plugins.data import load_eval_prompts

            eval_prompts = load_eval_prompts(
                cfg, reg, self.tokenizer, self._given_eval_dataset, self.task,
                trains_on_task=self._given_dataset is None,
            )
            self.evaluator = Evaluator(cfg, self.generator, self.rewards, self.tokenizer, eval_prompts, acc)
            self.eval_every = cfg.resolved_eval_steps(self.total_steps)
        # Sampling differs per process (each generates different completions), so seed by rank.
        set_seed(cfg.seed + acc.process_index)

    def _load_model(self) -> None:
        from grpo_plugins import models

        cfg, acc = self.config, self.accelerator
        model, self.tokenizer = models.policy_and_tokenizer(cfg, self._given_model, self._given_tokenizer, acc.device)
        self.is_peft = models.is_peft_model(model)
        if cfg.disable_dropout:
            models.disable_dropout(model)
        if cfg.cast_lm_head_to_fp32:
            models.cast_lm_head_to_fp32(model)
        if cfg.beta != 0.0 and not self.is_peft:
            # Full fine-tuning: the reference is a frozen copy of the starting weights.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            if cfg.fsdp is None:
                self.ref_model.to(acc.device)
        model.train()
        if cfg.fsdp is not None:
            self._shard(model)
            return
        if not is_quantized(model):  # a quantised model was built on its device
            # Before anything is made from the parameters: the master copies and the optimizer
            # state must live where the optimizer steps, whichever generator follows.
            model.to(acc.device)
        self.trainable = trainable_parameters(model, cfg.dtype)
        self.master = master_weights_for(self.trainable, cfg.master_weights)
        stepped = self.master.params if self.master is not None else self.trainable
        self.model, self.optimizer = acc.prepare(model, make_optimizer(stepped, cfg, acc.device))
        self.unwrapped = acc.unwrap_model(self.model)
        self.compiled_layers = compiled_layers_for(
            self.unwrapped, cfg.compile_layers, acc.device, quantized=is_quantized(self.unwrapped)
        )

    def _shard(self, model: Any) -> None:
        """FSDP: shard the policy (and the reference) over the processes; the optimizer steps the
        shards. 16-bit weights are sharded in float32 (the master weights, unless
        ``master_weights: false``) and gathered in 16 bits for each forward."""
        cfg, acc = self.config, self.accelerator
        assert cfg.fsdp is not None
        dtype = next(model.parameters()).dtype
        compute = dtype if dtype in (torch.bfloat16, torch.float16) and cfg.master_weights is not False else None
        layers = sharding.shard_model(model, cfg.fsdp, acc.device, acc.num_processes, compute_dtype=compute)
        if self.ref_model is not None:
            sharding.shard_model(self.ref_model, cfg.fsdp, acc.device, acc.num_processes)
        if acc.is_main_process:
            logger.info(
                "fsdp: %d layers and the root sharded over %d process(es)%s", layers, acc.num_processes,
                f", float32 shards computing in {dtype}" if compute is not None else "",
            )
        self.trainable = trainable_parameters(model, cfg.dtype)
        self.master = None
        self.model = self.unwrapped = model
        self.optimizer = acc.prepare(make_optimizer(self.trainable, cfg, acc.device, fused=False))
        self.compiled_layers = None

    def _load_data(self) -> None:
        from grpo_plugins.data import prepare_dataset

        cfg, plan = self.config, self.plan
        assert plan is not None
        environment = self.environment
        self.dataset, self.task, self.prompt_column = prepare_dataset(
            cfg, self.registry, self.tokenizer, self._given_dataset,
            encode=lambda prompts: environment.encode_prompts(prompts, None, "error"),
        )
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        else:
            cycles = math.ceil(cfg.num_train_epochs * len(self.dataset) / plan.unique_prompts)
            self.total_steps = max(1, cycles) * sum(s.optimizer_update for s in plan.cycle(0))

    def _teardown(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        close_environment = getattr(self.environment, "close", None)
        if close_environment is not None:  # e.g. a tool environment's worker threads
            close_environment()
        close_generator = getattr(self.generator, "close", None)
        if close_generator is not None:  # e.g. vLLM's engine holds a third of the GPU
            close_generator()
        if self.writer is not None:
            self.writer.close()
        self.heap.release()
        if self._own_process_group:
            sharding.end_process_group()
            self._own_process_group = False

    # -- the loop ------------------------------------------------------------------------------

    def _run(self, resume_from: Path | None) -> TrainResult:
        cfg, acc, plan = self.config, self.accelerator, self.plan
        assert plan is not None and self.guard is not None and self.update is not None
        cycle, start_k, rollout, log_window, resumed_from = self._restore(resume_from)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.output_dir / "config.yaml", cfg.to_yaml())
        self.writer = MetricsWriter(
            self.output_dir, list(cfg.report_to), self.total_steps, self.global_step, enabled=acc.is_main_process,
            console=self.console,
        )
        self.log = StepLog(self.writer, cfg.logging_steps, self.total_steps, acc.device, log_window)
        last_saved = self.global_step if resumed_from is not None else -1
        final: Path | None = None
        if self.evaluator is not None and self.config.eval_on_start and self.global_step == 0:
            try:
                self._evaluate()
            except RewardFailed as failed:
                raise failed.error from None

        self.heap.freeze()  # the model, data and plugins stay alive to the end
        first_cycle = cycle
        while self.global_step < self.total_steps:
            steps = plan.cycle(cycle, acc.process_index)
            if rollout is None:
                rollout = self._next_rollout(cycle, saved=last_saved == self.global_step)
            windows = accumulation_windows(steps)
            window = AccumulationWindow()
            self.log.start_cycle()
            self._training_now = True
            for k in range(start_k, len(steps)):
                step, items = steps[k], rollout.window_items[windows[k]]
                phase(f"training step {self.global_step + 1}")
                with self.log.training(), self.guard.phase("training", self.global_step + 1):
                    self.update.micro_step(rollout, step, items, window)
                self._trace(cycle, step, rollout)
                if not step.optimizer_update:
                    continue
                with self.log.training(), self.guard.phase("training", self.global_step + 1):
                    record = self._optimizer_step(rollout, window, items)
                window = AccumulationWindow()
                self.log.step(self.global_step, record, self.num_tokens)
                done = self.global_step >= self.total_steps
                mid_cycle = k + 1 < len(steps)
                if self.evaluator is not None and self.global_step % self.eval_every == 0:
                    try:
                        self._evaluate()
                    except RewardFailed as failed:
                        # The step is done: keep it (as a failing reward in a rollout does).
                        if self.global_step != last_saved:
                            if mid_cycle:
                                self._save(cycle, k + 1, rollout)
                            else:
                                self._save(cycle + 1, 0, None)
                        raise failed.error from None
                if done or (cfg.save_steps and self.global_step % cfg.save_steps == 0):
                    final = self._save(cycle, k + 1, rollout) if mid_cycle else self._save(cycle + 1, 0, None)
                    last_saved = self.global_step
                if done:
                    break
                if self._stop_requested:  # Ctrl-C: between optimizer steps, a checkpoint resumes exactly
                    self._training_now = False
                    if last_saved != self.global_step:
                        self._save(cycle, k + 1, rollout) if mid_cycle else self._save(cycle + 1, 0, None)
                    raise TrainingInterrupted(self.global_step, self.guard.last_checkpoint, saved_now=True)
            self._training_now = False
            cycle, start_k, rollout = cycle + 1, 0, None
            if cycle == first_cycle + 1 and self.global_step < self.total_steps:
                self.heap.freeze()  # and so do the graphs the first cycle compiled (not its rollout)
        if final is None and last_saved == self.global_step and resumed_from is not None:
            final = resumed_from  # resumed a finished run: nothing left to do
        return TrainResult(
            output_dir=self.output_dir,
            global_step=self.global_step,
            metrics=self.log.last_logged,
            checkpoint=final if acc.is_main_process else None,
            history=self.log.history,
            evals=self.evals,
        )

    def _evaluate(self) -> None:
        """Evaluate the policy now and log ``eval/...`` metrics at the current step (training's
        random streams and the generator's state are left as they were)."""
        assert self.evaluator is not None and self.writer is not None and self.guard is not None
        phase(f"evaluating at step {self.global_step}")
        with self.guard.phase("evaluation", self.global_step), self._full_weights():
            result = self.evaluator.run(step=self.global_step, model=f"step {self.global_step}")
        metrics = result.metrics()
        self.writer.log_eval(self.global_step, metrics)
        self.evals.append({"step": self.global_step, **metrics})

    def _next_rollout(self, cycle: int, saved: bool) -> Rollout:
        """The rollout of ``cycle``; a failing reward or a NaN/inf with on_nonfinite: stop ends the
        run between cycles, after saving the progress made (unless ``saved`` already)."""
        assert self.rollouts is not None and self.guard is not None and self.log is not None
        rng_at_cycle_start = capture_rng()
        generator_at_cycle_start = self.generator.state_dict() if hasattr(self.generator, "state_dict") else None
        t0 = time.perf_counter()
        try:
            with self.guard.phase("generation", self.global_step + 1), self._full_weights():
                rollout = self.rollouts.make(cycle, self.global_step + 1, self.writer, self.next_prompt)
        except (RewardFailed, NonFiniteError) as failed:
            if self.global_step > 0 and not saved:
                self._save(cycle, 0, None, rng_at_cycle_start)
            raise getattr(failed, "error", failed) from None
        except KeyboardInterrupt:
            # Nothing of this cycle is trained yet: its start is an exact place to resume from.
            saved_now = self.global_step > 0 and not saved and self.accelerator.num_processes == 1
            if saved_now:
                if generator_at_cycle_start is not None:  # its call counter seeds the next generation
                    self.generator.load_state_dict(generator_at_cycle_start)
                self._save(cycle, 0, None, rng_at_cycle_start)
            raise TrainingInterrupted(self.global_step, self.guard.last_checkpoint, saved_now) from None
        self.log.rollout_done(rollout, time.perf_counter() - t0)
        self.num_tokens += rollout.num_tokens
        self.next_prompt = rollout.next_prompt
        return rollout

    def _full_weights(self) -> Any:
        """FSDP: the policy's and the reference's full weights for the block (generation and the
        log-prob passes decode with them on each process alone); otherwise nothing."""
        return sharding.gathered(self.unwrapped, self.ref_model)

    def _optimizer_step(self, rollout: Rollout, window: AccumulationWindow, window_items: float) -> dict[str, float]:
        assert self.update is not None
        record = self.update.optimizer_step(rollout, window, window_items, self.global_step + 1)
        self.global_step += 1
        cfg = self.config
        if cfg.sync_ref_model and self.ref_model is not None and self.global_step % cfg.ref_model_sync_steps == 0:
            sync_reference(self.ref_model, self.unwrapped, cfg.ref_model_mixup_alpha)
        self.generator.on_weights_updated(self.unwrapped)
        return record

    def _trace(self, cycle: int, step: Step, rollout: Rollout) -> None:
        batch = rollout.prompt_index[step.rows]
        process = self.accelerator.process_index
        self.trace.append(dict(cycle=cycle, step=step.step, batch=batch, optimizer_update=step.optimizer_update, process=process))

    # -- checkpoints -----------------------------------------------------------------------------

    def _restore(
        self, path: Path | None
    ) -> tuple[int, int, Rollout | None, list[dict[str, float]], Path | None]:
        """Load the checkpoint at ``path``, if any: (cycle, next micro-step, the mid-cycle
        rollout, the logging window, the checkpoint path)."""
        acc = self.accelerator
        if path is None:
            return 0, 0, None, [], None
        state, rng, saved = load_checkpoint(
            path, acc, model=self.unwrapped, optimizer=self.optimizer, scheduler=self.scheduler, scaler=acc.scaler,
            master_weights=self.master, ref_model=self.ref_model if self.config.sync_ref_model else None,
        )
        if "entropy_control" in state:
            assert self.update is not None
            self.update.entropy.load_state_dict(state["entropy_control"])
        self.global_step, self.num_tokens = state["global_step"], state["num_tokens"]
        assert self.plan is not None  # checkpoints from before dynamic sampling: one cycle, one batch of prompts
        consumed = state["cycle"] + (1 if state.get("mid_cycle") else 0)
        self.next_prompt = state.get("next_prompt", consumed * self.plan.unique_prompts)
        if "generator" in state and hasattr(self.generator, "load_state_dict"):
            self.generator.load_state_dict(state["generator"])
        if rng is not None:
            restore_rng(rng)
        rollout = Rollout.from_state(saved, acc.device) if saved is not None else None
        self.generator.on_weights_updated(self.unwrapped)
        assert self.guard is not None
        self.guard.last_checkpoint = path
        logger.info("resumed from %s at step %d", path, self.global_step)
        return state["cycle"], state["next_micro_step"], rollout, state.get("log_window", []), path

    def _save(self, cycle: int, next_micro_step: int, rollout: Rollout | None, rng: dict[str, Any] | None = None) -> Path:
        """Checkpoint the run; it resumes at micro-step ``next_micro_step`` of ``cycle`` (with
        ``rollout`` when that is mid-cycle) and with the RNG state ``rng`` (default: now's)."""
        acc = self.accelerator
        assert self.log is not None and self.guard is not None
        phase(f"saving checkpoint {self.global_step}")
        state = {
            "global_step": self.global_step,
            "cycle": cycle,
            "next_micro_step": next_micro_step,
            "mid_cycle": rollout is not None,
            "num_tokens": self.num_tokens,
            "next_prompt": self.next_prompt,
            "num_processes": acc.num_processes,
            "total_steps": self.total_steps,
            "log_window": self.log.window,
        }
        if hasattr(self.generator, "state_dict"):
            state["generator"] = self.generator.state_dict()
        if self.update is not None and self.update.entropy.enabled:
            state["entropy_control"] = self.update.entropy.state_dict()
        path = save_checkpoint(
            acc, self.output_dir, self.global_step, model=self.unwrapped, tokenizer=self.tokenizer,
            optimizer=self.optimizer, scheduler=self.scheduler, rng_state=rng if rng is not None else capture_rng(),
            rollout=rollout.to_state() if rollout is not None else None, state=state,
            config_yaml=self.config.to_yaml(), save_total_limit=self.config.save_total_limit, scaler=acc.scaler,
            master_weights=self.master, ref_model=self.ref_model if self.config.sync_ref_model else None,
        )
        self.guard.last_checkpoint = path
        return path


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
