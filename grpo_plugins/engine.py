"""The GRPO training loop on accelerate (SPEC §5, §8).

One implementation behind two entry points: ``run_training(config)`` (the ``grpo-plugins
train`` command) and ``Engine(config, model=..., tokenizer=..., rewards=[...], dataset=...)``
for people coming from TRL or Unsloth who already hold a model, reward functions and data.

Each *generation cycle* follows the :class:`~grpo_plugins.batching.BatchPlan` exactly:

1. every process generates its share of the generation batch (prompts repeated
   ``num_generations`` times, groups consecutive) and scores it with the rewards;
2. the reward table is gathered from all processes, advantages are computed over the whole
   batch, and each process keeps the rows it owns;
3. old log-probs are computed only when an optimizer update falls inside the cycle, reference
   log-probs only when ``beta != 0`` (with LoRA: the same model with the adapter disabled);
4. the planned micro-steps run with gradient accumulation (DDP gradient sync only on the
   micro-step that ends an accumulation window), gradient clipping, optimizer and scheduler
   steps; ``num_iterations`` passes reuse the batch.

The same script runs on a CPU, one GPU, or several processes under ``accelerate launch`` /
``torchrun`` (DDP; gloo on CPUs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import resource
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_plugins.batching import BatchPlan, Step, plan_from_config
from grpo_plugins.compiled_layers import compile_stats
from grpo_plugins.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from grpo_plugins.config import GRPOConfig, component_ref, load_config
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators import generator_ref
from grpo_plugins.guards import NonFiniteError, RunGuard, check_prompt_lengths
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.metrics import MetricsWriter, average, completion_metrics, reward_metrics
from grpo_plugins.registry import Registry, get_registry

logger = logging.getLogger(__name__)

__all__ = ["Engine", "NonFiniteError", "TrainResult", "TrainingError", "run_training"]


class TrainingError(GRPOPluginsError):
    """The run cannot start or continue as configured."""


@dataclass
class TrainResult:
    """What a finished run leaves behind.

    Attributes:
        output_dir: the run's output directory.
        global_step: optimizer steps taken (including those before a resume).
        metrics: the last logged metrics.
        checkpoint: the final checkpoint directory (None on non-main processes).
        history: every metrics record this run logged (main process).
    """

    output_dir: Path
    global_step: int
    metrics: dict[str, float]
    checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)


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
    sampling_logps: Tensor | None  # (L, T) when the rollout correction is on
    window_items: list[float]  # active tokens of each accumulation window, all processes
    metrics: dict[str, float]  # reward and completion statistics of the whole batch
    num_tokens: int  # prompt + completion tokens of the whole batch (all processes)
    generate_seconds: float
    reward_seconds: float
    nonfinite: str | None = None  # the component that produced a NaN/inf reward or advantage

    def to_state(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device | str = "cpu") -> Rollout:
        return cls(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in state.items()})


def _as_config(config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str]) -> GRPOConfig:
    if isinstance(config, GRPOConfig):
        return config
    return load_config(config)


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
        registry: where components are looked up (default: the process-wide registry).

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
        registry: Registry | None = None,
    ) -> None:
        self.config = _as_config(config)
        if model is not None and tokenizer is None:
            raise TrainingError("Engine(model=...) needs the model's tokenizer too: pass tokenizer=...")
        if registry is None:
            registry = Registry(disabled=self.config.disable_plugins) if self.config.disable_plugins else get_registry()
        self.registry = registry
        if model is None and rewards is None and dataset is None:
            # The config-only path gets the same complete check as `grpo-plugins validate`.
            from grpo_plugins.validation import validate_config

            validate_config(self.config, self.registry)
        self._given_model = model
        self._given_tokenizer = tokenizer
        self._given_rewards = list(rewards) if rewards is not None else None
        self._given_dataset = dataset
        self.trace: list[dict[str, Any]] = []
        self.ref_model: Any = None
        self.model: Any = None
        self.tokenizer: Any = None

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
        self._setup()
        try:
            return self._run(resume)
        finally:
            self._teardown()

    # -- setup ---------------------------------------------------------------------------------

    def _setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import set_seed

        cfg = self.config
        if cfg.dtype == "float16" and not torch.cuda.is_available():
            raise TrainingError("dtype: float16 trains with a CUDA gradient scaler; on a CPU use float32 or bfloat16")
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        # accelerate only sets up gloo for a CPU-only multi-process launch (torchrun) when told to.
        cpu_only = world > 1 and not torch.accelerator.is_available()
        # Each run sets its own precision: drop the settings an earlier Accelerator in this process
        # (another Engine in a notebook, a benchmark) left behind, keeping the process group.
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = acc = Accelerator(
            mixed_precision="fp16" if cfg.dtype == "float16" else "no", cpu=cpu_only
        )
        if acc.num_processes != world:
            raise TrainingError(
                f"launched as {world} processes (WORLD_SIZE) but accelerate set up {acc.num_processes}; "
                "launch with `accelerate launch` or torchrun on a supported device"
            )
        set_seed(cfg.seed)
        self.plan: BatchPlan = plan_from_config(cfg, acc.num_processes)
        if self.plan.num_processes != acc.num_processes:
            raise TrainingError(
                f"num_processes is {cfg.num_processes} in the config but the run has "
                f"{acc.num_processes} processes; remove num_processes (it is for plan/validate)"
            )
        self._load_model()
        self._build_components()
        self._load_data()
        self._build_rewards()
        self.guard = RunGuard(cfg, self.rewards.names, self.registry)
        self._build_scheduler()
        # Sampling differs per process (each generates different completions), so seed by rank.
        set_seed(cfg.seed + acc.process_index)

    def _load_model(self) -> None:
        from grpo_plugins import models

        cfg, acc = self.config, self.accelerator
        if self._given_model is None:
            model, tokenizer = models.load_model_and_tokenizer(cfg)
        else:
            model, tokenizer = self._given_model, models.prepare_tokenizer(self._given_tokenizer)
            if cfg.lora is not None and not hasattr(model, "peft_config"):
                model = models.apply_lora(model, cfg.lora)
            if cfg.gradient_checkpointing:
                models.enable_gradient_checkpointing(model)
        self.is_peft = hasattr(model, "peft_config") and hasattr(model, "disable_adapter")
        if cfg.beta != 0.0 and not self.is_peft:
            # Full fine-tuning: the reference is a frozen copy of the starting weights.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(acc.device)
        model.train()
        self.tokenizer = tokenizer

        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise TrainingError("the model has no trainable parameters (all have requires_grad=False)")
        if cfg.dtype == "float16":
            # fp16 trains with fp32 weights under autocast and a gradient scaler.
            for p in self.trainable:
                p.data = p.data.float()
        self.master = self._master_weights()
        opt_params = self.master.params if self.master is not None else self.trainable
        decay = [p for p in opt_params if p.dim() >= 2]
        no_decay = [p for p in opt_params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        # On CUDA the fused kernel: one launch per step and no parameter-sized temporaries (the
        # default multi-tensor path allocates some, which set the peak memory of a small model).
        fused = True if acc.device.type == "cuda" else None
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=fused
        )
        # The scheduler is not prepared: accelerate would step it once per process.
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.unwrapped = acc.unwrap_model(self.model)
        self.compiled_layers = self._compile_layers()
        self._chunk_fn = self.compiled_layers.chunk_logps if self.compiled_layers is not None else None
        self._multiple = 8 if self.compiled_layers is not None else 1  # sequence length multiple (_trim)

    def _master_weights(self) -> Any:
        """float32 master copies of 16-bit trainable weights (see ``precision``), or None."""
        from grpo_plugins.precision import MasterWeights, needs_master_weights

        wanted = self.config.master_weights
        if wanted is False or not needs_master_weights(self.trainable):
            return None
        return MasterWeights(self.trainable)

    def _compile_layers(self) -> Any:
        """The decoder layers' compiled forwards for the training and log-prob passes, or None.

        Default (``compile_layers: null``): on for full fine-tuning on CUDA, where it cut the
        micro-step of a 0.5B model by 40 %; off for LoRA, where on the embedded model it was no
        faster (0.93 vs 0.87 s/step on an H200) and a run stopped with a non-finite LoRA gradient
        at step 36 that eager runs never showed (docs/performance.md).
        """
        from grpo_plugins.compiled_layers import CompiledLayers

        on_cuda = self.accelerator.device.type == "cuda"
        wanted = self.config.compile_layers
        if not (on_cuda and not self.is_peft if wanted is None else wanted):
            return None
        # Without a GPU there is nothing to gain from generated kernels; "aot_eager" traces the
        # same graphs without needing a C++ compiler (what the CPU tests exercise).
        return CompiledLayers.for_model(self.unwrapped, backend="inductor" if on_cuda else "aot_eager")

    @contextlib.contextmanager
    def _layers(self) -> Iterator[None]:
        """The compiled layers inside the block (when on); a compilation failure becomes one
        clear error instead of torch.compile's traceback."""
        if self.compiled_layers is None:
            yield
            return
        from torch._dynamo.exc import TorchDynamoException

        try:
            with self.compiled_layers.active():
                yield
        except TorchDynamoException as exc:
            cause: BaseException = exc
            while True:  # down to the backend's own error (BackendCompilerFailed wraps it)
                inner = getattr(cause, "inner_exception", None) or cause.__cause__
                if not isinstance(inner, BaseException):
                    break
                cause = inner
            text = str(cause).strip()
            reason = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
            raise TrainingError(
                f"compile_layers: torch.compile failed on this model ({reason}); "
                "set compile_layers: false to train without compiling"
            ) from exc

    def _build_components(self) -> None:
        from grpo_plugins.objective import resolve_component

        cfg, reg = self.config, self.registry
        # fast_inference selects vllm, with a clear error where it is not installed.
        gen_ref = generator_ref(cfg, cuda=self.accelerator.device.type == "cuda")
        self.generator = reg.build("generator", gen_ref.name, gen_ref.params)
        self.generator.setup(
            self.unwrapped,
            self.tokenizer,
            SamplingSettings(
                max_completion_length=cfg.max_completion_length,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                min_p=cfg.min_p,
                repetition_penalty=cfg.repetition_penalty,
                seed=None,  # sampling uses the global RNG, which checkpoints save and restore
            ),
        )
        tis = cfg.vllm_importance_sampling_correction
        self.correction = (not getattr(self.generator, "samples_from_policy", True)) if tis == "auto" else bool(tis)

        self.loss_settings: dict[str, Any] = {
            "loss_type": resolve_component("loss_type", cfg.loss_type, reg),
            "importance_sampling_level": resolve_component("importance_sampling", cfg.importance_sampling_level, reg),
            "rollout_correction": resolve_component("rollout_correction", cfg.rollout_correction, reg),
            "epsilon": cfg.epsilon,
            "epsilon_high": cfg.resolved_epsilon_high,
            "delta": cfg.delta,
            "beta": cfg.beta,
            "max_completion_length": cfg.max_completion_length,
            "vllm_importance_sampling_correction": self.correction,
            "vllm_importance_sampling_cap": cfg.vllm_importance_sampling_cap,
            "registry": reg,
        }
        self.scaling = resolve_component("reward_scaling", cfg.scale_rewards, reg)

    def _build_rewards(self) -> None:
        from grpo_plugins.rewards import RewardRunner, reward_specs_for

        cfg = self.config
        if self._given_rewards is not None:
            specs: list[Any] = list(self._given_rewards)
            weights = cfg.reward_weights
        else:
            task = self.task
            task_ref = component_ref(cfg.task)
            if task is None and task_ref is not None and not cfg.rewards:
                task = self.registry.get("task", task_ref.name)  # only its default rewards
            specs, weights = reward_specs_for(cfg, task), None
        self.rewards = RewardRunner(specs, self.registry, reward_weights=weights)

    def _load_data(self) -> None:
        from grpo_plugins import data

        cfg = self.config
        self.task = None
        self.prompt_column = cfg.dataset.prompt_column if cfg.dataset is not None else "prompt"
        if self._given_dataset is not None:
            dataset = self._given_dataset
            if isinstance(dataset, list):
                import datasets

                dataset = datasets.Dataset.from_list(dataset)
            elif isinstance(dataset, Mapping):
                import datasets

                dataset = datasets.Dataset.from_dict(dict(dataset))
        else:
            dataset, self.task = data.load_prompts(cfg, self.registry)
            if self.prompt_column not in dataset.column_names and "prompt" in dataset.column_names:
                self.prompt_column = "prompt"
        if self.prompt_column not in dataset.column_names:
            raise TrainingError(
                f"the dataset has no '{self.prompt_column}' column (columns: {', '.join(dataset.column_names)}); "
                "name the prompt column with dataset.prompt_column"
            )
        if len(dataset) == 0:
            raise TrainingError("the dataset is empty")
        check_prompt_lengths(
            self.tokenizer,
            dataset[self.prompt_column],
            max_prompt_length=cfg.max_prompt_length,
            truncation=cfg.prompt_truncation,
        )
        self.dataset = dataset
        self.stream = PromptStream(len(dataset), cfg.seed)
        self.updates_per_cycle = sum(s.optimizer_update for s in self.plan.cycle(0))
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        else:
            cycles = math.ceil(cfg.num_train_epochs * len(dataset) / self.plan.unique_prompts)
            self.total_steps = max(1, cycles) * self.updates_per_cycle

    def _build_scheduler(self) -> None:
        from transformers import get_scheduler

        cfg = self.config
        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.total_steps)
        kwargs: dict[str, Any] = {}
        if cfg.lr_scheduler_type == "cosine_with_min_lr":
            kwargs["scheduler_specific_kwargs"] = {"min_lr_rate": 0.1}
        self.scheduler = get_scheduler(
            cfg.lr_scheduler_type,
            optimizer=self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer,
            num_warmup_steps=warmup,
            num_training_steps=self.total_steps,
            **kwargs,
        )

    def _teardown(self) -> None:
        rewards = getattr(self, "rewards", None)
        if rewards is not None:
            rewards.close()
        close_generator = getattr(getattr(self, "generator", None), "close", None)
        if close_generator is not None:  # e.g. vLLM's engine holds a third of the GPU
            close_generator()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()

    # -- the loop ------------------------------------------------------------------------------

    def _run(self, resume: str | os.PathLike[str] | bool | None) -> TrainResult:
        cfg, acc, plan = self.config, self.accelerator, self.plan
        output_dir = Path(cfg.output_dir)
        self.output_dir = output_dir
        self.global_step, cycle, start_k = 0, 0, 0
        self.num_tokens = 0
        rollout: Rollout | None = None
        log_window: list[dict[str, float]] = []
        checkpoint_path = resolve_resume(resume, output_dir)
        if checkpoint_path is None and latest_checkpoint(output_dir) is not None and acc.is_main_process:
            logger.warning(
                "%s already holds checkpoints of an earlier run; this fresh run will save its own next to "
                "them (use --resume to continue that run, or another output_dir)",
                output_dir,
            )
        if checkpoint_path is not None:
            state, rng, saved = load_checkpoint(
                checkpoint_path,
                acc,
                model=self.unwrapped,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=acc.scaler,
                master_weights=self.master,
            )
            self.global_step, cycle, start_k = state["global_step"], state["cycle"], state["next_micro_step"]
            self.num_tokens = state["num_tokens"]
            log_window = state.get("log_window", [])
            if "generator" in state and hasattr(self.generator, "load_state_dict"):
                self.generator.load_state_dict(state["generator"])
            if rng is not None:
                restore_rng(rng)
            rollout = Rollout.from_state(saved, acc.device) if saved is not None else None
            self.generator.on_weights_updated(self.unwrapped)
            self.guard.last_checkpoint = checkpoint_path
            logger.info("resumed from %s at step %d", checkpoint_path, self.global_step)
        if acc.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(output_dir / "config.yaml", self._config_yaml())
        self.writer = MetricsWriter(
            output_dir, list(cfg.report_to), self.total_steps, self.global_step, enabled=acc.is_main_process
        )
        self.history: list[dict[str, float]] = []
        last_logged: dict[str, float] = {}
        last_saved = self.global_step if checkpoint_path is not None else -1
        final: Path | None = None

        # Counters since the previous optimizer step, for the timing metrics.
        self._pending = {"generate": 0.0, "reward": 0.0, "rollout": 0.0, "tokens": 0.0}
        while self.global_step < self.total_steps:
            steps = plan.cycle(cycle, acc.process_index)
            if rollout is None:
                rng_at_cycle_start = capture_rng()
                t0 = time.perf_counter()
                try:
                    with self.guard.phase("generation", self.global_step + 1):
                        rollout = self._rollout(cycle)
                except (_RewardFailed, NonFiniteError) as failed:
                    # Stopped between cycles: the state is consistent, so keep the progress made.
                    if self.global_step > 0 and last_saved != self.global_step:
                        self._save(cycle, 0, None, rng_at_cycle_start, log_window)
                    raise getattr(failed, "error", failed) from None
                self._pending["generate"] += rollout.generate_seconds
                self._pending["reward"] += rollout.reward_seconds
                self._pending["rollout"] += time.perf_counter() - t0  # also old/ref log-probs
                self.num_tokens += rollout.num_tokens
            windows = _windows(steps)
            window_losses: list[Tensor] = []
            window_metrics: list[Any] = []
            entropy_sum = torch.zeros((), device=acc.device)
            entropy_count = torch.zeros((), device=acc.device)
            step_start = time.perf_counter()
            train_seconds = 0.0
            for k in range(start_k, len(steps)):
                step = steps[k]
                t0 = time.perf_counter()
                with self.guard.phase("training", self.global_step + 1):
                    loss, lm, ent_sum, ent_count = self._micro_step(rollout, step, rollout.window_items[windows[k]])
                train_seconds += time.perf_counter() - t0
                window_losses.append(loss)
                window_metrics.append(lm)
                entropy_sum += ent_sum
                entropy_count += ent_count
                self.trace.append(
                    {
                        "cycle": cycle,
                        "step": step.step,
                        "batch": rollout.prompt_index[step.rows],
                        "optimizer_update": step.optimizer_update,
                        "process": acc.process_index,
                    }
                )
                if not step.optimizer_update:
                    continue
                t0 = time.perf_counter()
                with self.guard.phase("training", self.global_step + 1):
                    record = self._optimizer_step(
                        rollout, window_losses, window_metrics, entropy_sum, entropy_count, rollout.window_items[windows[k]]
                    )
                train_seconds += time.perf_counter() - t0
                window_losses, window_metrics = [], []
                entropy_sum = torch.zeros((), device=acc.device)
                entropy_count = torch.zeros((), device=acc.device)
                step_seconds = time.perf_counter() - step_start + self._pending["rollout"]
                record.update(
                    {
                        "timing/generate": self._pending["generate"],
                        "timing/reward": self._pending["reward"],
                        "timing/train": train_seconds,
                        "timing/step": step_seconds,
                        "tokens_per_second": self._pending["tokens"] / max(step_seconds, 1e-9),
                        "num_tokens": float(self.num_tokens),
                        "peak_memory_gb": _peak_memory_gb(acc.device),
                    }
                )
                self._pending = dict.fromkeys(self._pending, 0.0)
                step_start, train_seconds = time.perf_counter(), 0.0
                log_window.append(record)
                self.writer.progress(self.global_step, record)
                if self.global_step % cfg.logging_steps == 0 or self.global_step == self.total_steps:
                    last_logged = average(log_window)
                    log_window = []
                    self.writer.log(self.global_step, last_logged)
                    self.history.append({"step": self.global_step, **last_logged})
                done = self.global_step >= self.total_steps
                if done or (cfg.save_steps and self.global_step % cfg.save_steps == 0):
                    mid_cycle = k + 1 < len(steps)
                    path = self._save(
                        cycle if mid_cycle else cycle + 1,
                        k + 1 if mid_cycle else 0,
                        rollout if mid_cycle else None,
                        capture_rng(),
                        log_window,
                    )
                    last_saved = self.global_step
                    final = self.guard.last_checkpoint = path
                if done:
                    break
            cycle, start_k, rollout = cycle + 1, 0, None
        if final is None and last_saved == self.global_step and checkpoint_path is not None:
            final = checkpoint_path  # resumed a finished run: nothing left to do
        return TrainResult(
            output_dir=output_dir,
            global_step=self.global_step,
            metrics=last_logged,
            checkpoint=final if acc.is_main_process else None,
            history=self.history,
        )

    # -- generation and scoring ------------------------------------------------------------------

    def _rollout(self, cycle: int) -> Rollout:
        from grpo_plugins.advantages import compute_advantages
        from grpo_plugins.data import encode_prompts, left_pad
        from grpo_plugins.rewards import RewardError

        cfg, acc, plan = self.config, self.accelerator, self.plan
        rank, G = acc.process_index, plan.num_generations
        L = plan.completions_per_process
        share = plan.prompt_indices(cycle)[plan.process_rows(rank)]  # (L,) prompt index per row
        unique = sorted(set(share))
        rows = {i: self.dataset[self.stream.row(i)] for i in unique}
        encoded = encode_prompts(
            self.tokenizer,
            [rows[i][self.prompt_column] for i in unique],
            max_prompt_length=cfg.max_prompt_length,
            truncation=cfg.prompt_truncation,
        )
        ids_of = dict(zip(unique, encoded))
        prompt_ids = [list(ids_of[i]) for i in share]

        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.generator.generate(prompt_ids)
        generate_seconds = time.perf_counter() - t0

        completion_ids = out.completion_ids.to(acc.device)  # (L, T)
        completion_mask = out.completion_mask.to(acc.device).long()  # (L, T)
        truncated = out.is_truncated.to(acc.device).bool()  # (L,)
        lengths = completion_mask.sum(1)  # (L,)
        id_lists = [completion_ids[i, : int(lengths[i])].tolist() for i in range(L)]
        texts = self.tokenizer.batch_decode(id_lists, skip_special_tokens=True)
        prompts = [rows[i][self.prompt_column] for i in share]
        columns = {
            name: [rows[i][name] for i in share] for name in self.dataset.column_names if name != self.prompt_column
        }

        t0 = time.perf_counter()
        error: Exception | None = None
        try:
            local_rewards = self.rewards(prompts, texts, id_lists, columns, step=self.global_step).to(acc.device)  # (L, K)
        except RewardError as exc:
            error = exc
            local_rewards = torch.zeros(L, len(self.rewards.names), device=acc.device)
        reward_seconds = time.perf_counter() - t0
        failed = acc.gather(torch.tensor([1.0 if error is not None else 0.0], device=acc.device))
        if bool(failed.any()):
            if error is None:
                error = TrainingError(f"a reward failed on process {int(failed.nonzero()[0])}; see its message")
            raise _RewardFailed(error)

        all_rewards = acc.gather(local_rewards)  # (N, K) N = L * num_processes, process order
        advantages_all = compute_advantages(
            all_rewards.double(),
            num_generations=G,
            reward_weights=self.rewards.weights,
            scale_rewards=self.scaling,
            multi_objective_aggregation=cfg.multi_objective_aggregation,
            registry=self.registry,
        ).float()  # (N,)
        advantages = advantages_all[rank * L : (rank + 1) * L]  # (L,)
        nonfinite = self.guard.check_rollout(all_rewards, advantages_all, self.global_step + 1)

        loss_mask = completion_mask.float()  # (L, T)
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~truncated).float().unsqueeze(1)
        prompt_tensor, prompt_mask = left_pad(prompt_ids, self.tokenizer.pad_token_id, device=acc.device)  # (L, P)
        input_ids = torch.cat([prompt_tensor, completion_ids], dim=1)  # (L, P+T)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (L, P+T)

        steps = plan.cycle(cycle, rank)
        windows = _windows(steps)
        local_items = torch.zeros(max(windows) + 1, device=acc.device, dtype=torch.float64)
        for k, step in enumerate(steps):
            local_items[windows[k]] += loss_mask[step.rows].sum().double()
        window_items = acc.reduce(local_items, reduction="sum").tolist()

        all_lengths = acc.gather(lengths)
        all_truncated = acc.gather(truncated.long())
        num_tokens = int(acc.reduce(attention_mask.sum().double(), reduction="sum"))
        self._pending["tokens"] += float(num_tokens)
        metrics = {
            **reward_metrics(all_rewards, self.rewards.names, self.rewards.weights, G),
            **completion_metrics(all_lengths, all_truncated.bool()),
        }
        if cfg.log_completions:
            self._log_completions(prompts, texts, local_rewards, advantages)

        rollout = Rollout(
            prompt_index=list(share),
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logps=None,
            ref_logps=None,
            sampling_logps=None,
            window_items=window_items,
            metrics=metrics,
            num_tokens=num_tokens,
            generate_seconds=generate_seconds,
            reward_seconds=reward_seconds,
            nonfinite=nonfinite,
        )
        if self.correction:
            if out.sampling_logps is None:
                raise TrainingError(
                    "vllm_importance_sampling_correction is on but the generator returns no sampling "
                    "log-probs; set vllm_importance_sampling_correction: false or use a generator that does"
                )
            rollout.sampling_logps = out.sampling_logps.to(acc.device).float()
        with self.guard.phase("log-probs", self.global_step + 1):
            if not plan.on_policy:
                rollout.old_logps = self._batch_logps(rollout, self.unwrapped, steps)
            if cfg.beta != 0.0:
                if self.is_peft:
                    with self.unwrapped.disable_adapter():
                        rollout.ref_logps = self._batch_logps(rollout, self.unwrapped, steps)
                else:
                    rollout.ref_logps = self._batch_logps(rollout, self.ref_model, steps)
        return rollout

    def _batch_logps(self, rollout: Rollout, model: Any, steps: list[Step]) -> Tensor:
        """(L, T) log-probs of the whole share, one micro-batch at a time, without gradients."""
        from grpo_plugins.logprobs import completion_logps

        from grpo_plugins.row_chunks import row_chunks

        T = rollout.loss_mask.shape[1]
        out = torch.zeros_like(rollout.loss_mask)  # (L, T)
        with torch.no_grad(), self.accelerator.autocast(), self._layers():
            for step in steps[: self.plan.steps_per_generation]:
                # Trimmed per micro-batch, as in the training step, so each row sees the same input.
                ids, att, t = _trim(rollout.input_ids[step.rows], rollout.attention_mask[step.rows], T, self._multiple)
                rows = out[step.rows]  # (B, T) view
                for c in row_chunks(ids.shape[0], self.config.train_chunk_rows):
                    logps, _ = completion_logps(
                        model, ids[c], att[c], t, temperature=self.config.temperature,
                        chunk_size=self.config.logprob_chunk_size, chunk_fn=self._chunk_fn,
                    )  # (b, t)
                    rows[c, :t] = logps.float()
        return out

    def _log_completions(self, prompts: list[Any], texts: list[str], rewards: Tensor, advantages: Tensor) -> None:
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
        self.writer.log_completions(self.global_step + 1, records)

    # -- training --------------------------------------------------------------------------------

    def _micro_step(self, rollout: Rollout, step: Step, window_items: float) -> tuple[Tensor, Any, Tensor, Tensor]:
        """Forward+backward of one micro-step, ``train_chunk_rows`` rows at a time (the gradient,
        loss and metrics equal those of the whole micro-batch at once; see row_chunks)."""
        from grpo_plugins.logprobs import completion_logps
        from grpo_plugins.objective import LossMetrics, compute_loss
        from grpo_plugins.row_chunks import ChunkedReduction, row_chunks

        acc, cfg = self.accelerator, self.config
        r = step.rows
        T = rollout.loss_mask.shape[1]
        ids, att, t = _trim(rollout.input_ids[r], rollout.attention_mask[r], T, self._multiple)  # (B, P'+t)
        mask = rollout.loss_mask[r, :t]  # (B, t)
        advantages = rollout.advantages[r]  # (B,)
        chunks = row_chunks(mask.shape[0], cfg.train_chunk_rows)

        def cut(x: Tensor | None, c: slice) -> Tensor | None:
            return None if x is None else x[r, :t][c]

        losses: list[Tensor] = []
        metrics: list[Any] = []
        ent_sum = torch.zeros((), device=acc.device)
        for i, c in enumerate(chunks):
            # DDP syncs gradients once, on the backward that ends the accumulation window.
            last = i == len(chunks) - 1
            sync = contextlib.nullcontext() if step.optimizer_update and last else acc.no_sync(self.model)
            settings = self.loss_settings
            if len(chunks) > 1:
                settings = {**settings, "loss_type": ChunkedReduction(settings["loss_type"], mask, advantages, c)}
            # Backward inside _layers() too: activation checkpointing recomputes the layers then.
            with sync, self._layers():
                with acc.autocast():
                    logps, entropy = completion_logps(
                        self.model,
                        ids[c],
                        att[c],
                        t,
                        temperature=cfg.temperature,
                        chunk_size=cfg.logprob_chunk_size,
                        with_entropy=True,
                        chunk_fn=self._chunk_fn,
                    )  # (b, t) (b, t)
                    loss, chunk_metrics = compute_loss(
                        logps,
                        cut(rollout.old_logps, c),
                        advantages[c],
                        mask[c],
                        ref_per_token_logps=cut(rollout.ref_logps, c),
                        sampling_per_token_logps=cut(rollout.sampling_logps, c),
                        num_items_in_batch=window_items,
                        num_processes=acc.num_processes,
                        gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
                        **settings,
                    )
                acc.backward(loss)
            assert entropy is not None
            with torch.no_grad():
                ent_sum = ent_sum + (entropy.detach().float() * mask[c]).sum()
            losses.append(loss.detach().float())
            metrics.append(chunk_metrics)
        merged = metrics[0] if len(metrics) == 1 else LossMetrics.merge(metrics)
        return torch.stack(losses).sum(), merged, ent_sum, mask.sum()

    def _optimizer_step(
        self,
        rollout: Rollout,
        losses: list[Tensor],
        loss_metrics: list[Any],
        entropy_sum: Tensor,
        entropy_count: Tensor,
        window_items: float,
    ) -> dict[str, float]:
        from grpo_plugins.objective import LossMetrics

        acc, cfg = self.accelerator, self.config
        local_loss = torch.stack(losses).sum()
        step_loss = acc.reduce(local_loss.reshape(1), reduction="mean")  # NaN/inf if any process's is
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        if self.master is not None:
            self.master.grads_to_masters()
        opt_params = self.master.params if self.master is not None else self.trainable
        grad_norm = acc.clip_grad_norm_(opt_params, max_norm)
        grad_norm_value = float(grad_norm) if grad_norm is not None else 0.0
        lr = self.scheduler.get_last_lr()[0]
        step_number = self.global_step + 1
        names = [name for name, p in self.unwrapped.named_parameters() if p.requires_grad]
        grads = ((name, p.grad) for name, p in zip(names, opt_params))
        nonfinite = self.guard.check_update(
            step_number, float(step_loss), grad_norm_value, grads, rollout.nonfinite, loss_scaling=acc.scaler is not None
        )
        # No active token in the whole window (e.g. all completions truncated and masked): the
        # gradient is exactly zero and the parameters must not move, so AdamW does not step.
        hold = nonfinite or window_items == 0
        if hold:
            self.optimizer.zero_grad(set_to_none=True)
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
        self.global_step = step_number
        self.generator.on_weights_updated(self.unwrapped)

        merged = LossMetrics.merge(loss_metrics).all_reduce(acc)
        entropy = acc.reduce(torch.stack([entropy_sum, entropy_count]).double(), reduction="sum")
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
        return record

    # -- checkpoints -----------------------------------------------------------------------------

    def _save(
        self,
        cycle: int,
        next_micro_step: int,
        rollout: Rollout | None,
        rng: dict[str, Any],
        log_window: list[dict[str, float]],
    ) -> Path:
        acc = self.accelerator
        state = {
            "global_step": self.global_step,
            "cycle": cycle,
            "next_micro_step": next_micro_step,
            "mid_cycle": rollout is not None,
            "num_tokens": self.num_tokens,
            "num_processes": acc.num_processes,
            "total_steps": self.total_steps,
            "log_window": log_window,
        }
        if hasattr(self.generator, "state_dict"):
            state["generator"] = self.generator.state_dict()
        return save_checkpoint(
            acc,
            self.output_dir,
            self.global_step,
            model=self.unwrapped,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            rng_state=rng,
            rollout=rollout.to_state() if rollout is not None else None,
            state=state,
            config_yaml=self._config_yaml(),
            save_total_limit=self.config.save_total_limit,
            scaler=self.accelerator.scaler,
            master_weights=self.master,
        )

    def _config_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False)


class _RewardFailed(Exception):
    """Internal: a reward failed on some process during a rollout."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class PromptStream:
    """The run's prompt order: the dataset shuffled with a fresh seeded permutation per epoch.

    ``row(i)`` is the dataset row behind prompt index ``i`` (the index ``plan`` shows).
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, None

    def row(self, index: int) -> int:
        epoch, pos = divmod(index, self.size)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.size, generator=generator).tolist()
            self._epoch = epoch
        assert self._perm is not None
        return self._perm[pos]


def _windows(steps: list[Step]) -> list[int]:
    """For each micro-step of a cycle, the index of the accumulation window it belongs to."""
    out, w = [], 0
    for step in steps:
        out.append(w)
        if step.optimizer_update:
            w += 1
    return out


def _trim(input_ids: Tensor, attention_mask: Tensor, T: int, multiple: int = 1) -> tuple[Tensor, Tensor, int]:
    """Drop prompt columns that are padding in every row and completion columns past the longest
    completion; returns (ids, mask, kept completion length t >= 1).

    ``multiple``: keep (or add) left padding so the length is a multiple of it. Compiled layers
    use 8: SDPA's fused kernels need the mask's rows 16-byte aligned, and torch.compile guards on
    that divisibility, so lengths that break it would compile a second graph."""
    P = input_ids.shape[1] - T
    comp = attention_mask[:, P:]  # (B, T)
    t = max(1, int(comp.sum(1).max()) if comp.numel() else 1)
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


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_training(
    config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    resume: str | os.PathLike[str] | bool | None = None,
) -> TrainResult:
    """Train as ``config`` says (the ``grpo-plugins train`` command)."""
    return Engine(config).train(resume=resume)
