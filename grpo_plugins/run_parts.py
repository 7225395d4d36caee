"""The parts of a training run, built complete in one place: :func:`build_run_parts`.

A run needs, in this order: the accelerator and the batch plan; the policy with its optimizer
(and float32 master weights for 16-bit weights, a frozen reference for the KL term); the
generator; the environment; the data; the rewards; the guard; and from those the rollout maker,
the policy update and the evaluator. :class:`RunParts` holds them all, built, so that the
engine's loop reads them without checking whether they are there yet; :meth:`RunParts.close`
lets go of what holds threads, processes or GPU memory.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_plugins import sharding
from grpo_plugins.attention import training_passes
from grpo_plugins.batching import BatchPlan
from grpo_plugins.compile_cache import CompileCache
from grpo_plugins.compiled_layers import compiled_layers_for
from grpo_plugins.config import GRPOConfig
from grpo_plugins.episodes import build_environment
from grpo_plugins.evaluation import Evaluator
from grpo_plugins.generators import build_generator, generator_ref
from grpo_plugins.guards import RunGuard
from grpo_plugins.image_prompts import ImagePromptEncoder
from grpo_plugins.objective import Objective
from grpo_plugins.pass_budget import PassBudget
from grpo_plugins.policy import Policy, host_bound_tokens
from grpo_plugins.precision import MasterWeights
from grpo_plugins.prompts import PromptSource, PromptStream
from grpo_plugins.quantization import is_quantized
from grpo_plugins.registry import Registry, resolve_component
from grpo_plugins.rewards import reward_runner
from grpo_plugins.rollout import RolloutMaker
from grpo_plugins.runtime import make_accelerator
from grpo_plugins.update import PolicyUpdate, make_optimizer, make_scheduler, master_weights_for, trainable_parameters

logger = logging.getLogger(__name__)

__all__ = ["Given", "RunParts", "TrainedModel", "build_run_parts", "load_policy"]


@dataclass(frozen=True)
class Given:
    """What the caller of ``Engine(...)`` handed over instead of the config's own (None: build
    it from the config)."""

    model: Any = None
    tokenizer: Any = None
    rewards: list[Any] | None = None
    dataset: Any = None
    eval_dataset: Any = None
    environment: Any = None


@dataclass(frozen=True)
class TrainedModel:
    """The policy as the run trains it.

    Attributes:
        model: the accelerate-prepared model (DDP-wrapped on several processes).
        unwrapped: the same model without wrappers.
        tokenizer: its tokenizer.
        ref_model: a frozen copy for the KL term (full fine-tuning with ``beta != 0``), else None.
        is_peft: a peft model (its reference is the adapter disabled).
        trainable: the parameters that train.
        master: float32 copies that the optimizer steps (16-bit weights), else None.
        optimizer: the optimizer (accelerate-prepared).
        compiled_layers: the compiled decoder layers (``compile_layers``), else None.
        processor: a vision-language model's processor (what checkpoints save), else None.
    """

    model: Any
    unwrapped: Any
    tokenizer: Any
    ref_model: Any
    is_peft: bool
    trainable: list[torch.nn.Parameter]
    master: MasterWeights | None
    optimizer: Any
    compiled_layers: Any
    processor: Any = None


def load_policy(config: GRPOConfig, accelerator: Any, model: Any = None, tokenizer: Any = None) -> TrainedModel:
    """Load (or take) the policy and make what trains it: the reference copy, the master weights
    and the optimizer, all on the training device; FSDP shards the policy and the reference."""
    from grpo_plugins import models

    cfg, acc = config, accelerator
    model, tokenizer, processor = models.policy_and_tokenizer(cfg, model, tokenizer, acc.device)
    is_peft = models.is_peft_model(model)
    if cfg.disable_dropout:
        models.disable_dropout(model)
    if cfg.cast_lm_head_to_fp32:
        models.cast_lm_head_to_fp32(model)
    ref_model = None
    if cfg.beta != 0.0 and not is_peft:
        # Full fine-tuning: the reference is a frozen copy of the starting weights.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.fsdp is None:
            ref_model.to(acc.device)
    model.train()
    if cfg.fsdp is not None:
        trainable = _shard(cfg, acc, model, ref_model)
        optimizer = acc.prepare(make_optimizer(trainable, cfg, acc.device, fused=False))
        return TrainedModel(model, model, tokenizer, ref_model, is_peft, trainable, None, optimizer, None, processor)
    if not is_quantized(model):  # a quantised model was built on its device
        # Before anything is made from the parameters: the master copies and the optimizer
        # state must live where the optimizer steps, whichever generator follows.
        model.to(acc.device)
    trainable = trainable_parameters(model, cfg.dtype)
    master = master_weights_for(trainable, cfg.master_weights)
    stepped = master.params if master is not None else trainable
    prepared, optimizer = acc.prepare(model, make_optimizer(stepped, cfg, acc.device))
    unwrapped = acc.unwrap_model(prepared)
    compiled = compiled_layers_for(unwrapped, cfg.compile_layers, acc.device, quantized=is_quantized(unwrapped))
    return TrainedModel(
        prepared, unwrapped, tokenizer, ref_model, is_peft, trainable, master, optimizer, compiled, processor
    )


def _shard(config: GRPOConfig, acc: Any, model: Any, ref_model: Any) -> list[torch.nn.Parameter]:
    """FSDP: shard the policy (and the reference) over the processes; the optimizer steps the
    shards (returned). 16-bit weights are sharded in float32 (the master weights, unless
    ``master_weights: false``) and gathered in 16 bits for each forward."""
    assert config.fsdp is not None
    dtype = next(model.parameters()).dtype
    compute = dtype if dtype in (torch.bfloat16, torch.float16) and config.master_weights is not False else None
    layers = sharding.shard_model(model, config.fsdp, acc.device, acc.num_processes, compute_dtype=compute)
    if ref_model is not None:
        sharding.shard_model(ref_model, config.fsdp, acc.device, acc.num_processes)
    if acc.is_main_process:
        logger.info(
            "fsdp: %d layers and the root sharded over %d process(es)%s", layers, acc.num_processes,
            f", float32 shards computing in {dtype}" if compute is not None else "",
        )
    return trainable_parameters(model, config.dtype)


@dataclass(frozen=True)
class RunParts:
    """Everything a training run is made of, built (see :func:`build_run_parts`).

    Attributes:
        accelerator: the run's ``accelerate.Accelerator``.
        plan: the batch plan.
        policy: the trained model, its optimizer and master weights.
        scheduler: the learning-rate scheduler.
        generator: the set-up generator.
        environment: the set-up environment (built on the generator).
        dataset: the training prompts; ``prompt_column`` names their column.
        task: the config's task, built, or None.
        rewards: the reward runner.
        guard: NaN/inf checks, phase timeouts and advice.
        total_steps: optimizer steps of the whole run.
        rollouts: makes each cycle's rollout.
        update: the micro-steps and optimizer steps.
        evaluator: evaluates every ``eval_every`` steps (``eval_strategy: steps``), else None.
        compiles: the first step compiles (compiled layers or the static generator).
        own_process_group: FSDP on one process made a group of one, ended by :meth:`close`.
        compile_cache: torch's compile artifacts kept between runs (loaded already; saved by
            :meth:`save_compiled`).
    """

    accelerator: Any
    plan: BatchPlan
    policy: TrainedModel
    scheduler: Any
    generator: Any
    environment: Any
    dataset: Any
    prompt_column: str
    task: Any
    rewards: Any
    guard: RunGuard
    total_steps: int
    rollouts: RolloutMaker
    update: PolicyUpdate
    evaluator: Evaluator | None
    eval_every: int
    compiles: bool
    own_process_group: bool
    compile_cache: CompileCache = field(default_factory=lambda: CompileCache(None))

    def save_compiled(self) -> None:
        """Save what was compiled since the last save to the compile cache (main process)."""
        if self.accelerator.is_main_process:
            self.compile_cache.save_if_new()

    def close(self) -> None:
        """Let go of a generation ahead, the rewards' workers, the environment's threads, the generator's engine
        (vLLM holds a share of the GPU) and a process group of our own."""
        if self.rollouts.ahead is not None:  # a generation still running beside training finishes first
            self.rollouts.ahead.close()
        self.rewards.close()
        for part in (self.environment, self.generator):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        if self.own_process_group:
            sharding.end_process_group()


def image_encoder(config: GRPOConfig, processor: Any, environment: Any, columns: list[str]) -> ImagePromptEncoder | None:
    """The prompt encoder of a vision-language model's run (None for a text model); a text
    model given prompts with images is an error."""
    from grpo_plugins.episodes import TurnBasedEnvironment
    from grpo_plugins.errors import TrainingError
    from grpo_plugins.image_prompts import has_image_column

    if processor is None:
        if has_image_column(columns):
            raise TrainingError(
                "the dataset has an image/images column but the model is a text-only model; use a "
                "vision-language model (its config has a vision_config) or drop the images"
            )
        return None
    if isinstance(environment, TurnBasedEnvironment):
        raise TrainingError(
            "environment: multi-turn environments do not support vision-language models yet; use environment: single_turn"
        )
    if config.eval_strategy != "no":
        raise TrainingError("eval_strategy: evaluating a vision-language model is not supported yet; set eval_strategy: no")
    return ImagePromptEncoder(processor, config.max_prompt_length, config.chat_template_kwargs)


def build_run_parts(config: GRPOConfig, registry: Registry, given: Given) -> RunParts:
    """Build the parts of a run of ``config`` (components looked up in ``registry``), taking
    the ones in ``given``; seeds every process with ``config.seed`` while building, then with
    ``seed + process index`` for sampling."""
    from accelerate.utils import set_seed

    from grpo_plugins.advantages import compute_advantages
    from grpo_plugins.data import load_eval_prompts, prepare_dataset

    cfg, reg = config, registry
    acc, plan = make_accelerator(cfg, reg)
    own_process_group = sharding.ensure_process_group(acc.device) if cfg.fsdp is not None else False
    set_seed(cfg.seed)
    policy = load_policy(cfg, acc, given.model, given.tokenizer)
    tokenizer, vision = policy.tokenizer, policy.processor is not None
    generator = build_generator(cfg, reg, policy.unwrapped, tokenizer, acc.device, vision=vision)
    compiles = policy.compiled_layers is not None or (  # the static generator compiles on CUDA only
        acc.device.type == "cuda" and generator_ref(cfg, vision=vision).name == "static"
    )
    compile_cache = CompileCache(None)
    if compiles:
        compile_cache = CompileCache.for_run(policy.unwrapped, acc.device, _compile_settings(cfg, policy, generator))
        compile_cache.load()
    environment = build_environment(cfg, reg, generator, tokenizer, given.environment)
    dataset, task, prompt_column = prepare_dataset(
        cfg, reg, tokenizer, given.dataset, encode=lambda prompts: environment.encode_prompts(prompts, None, "error"),
        check_lengths=not vision,  # prompts with images are checked as they are encoded
    )
    images = image_encoder(cfg, policy.processor, environment, dataset.column_names)
    if cfg.max_steps is not None:
        total_steps = cfg.max_steps
    else:
        cycles = math.ceil(cfg.num_train_epochs * len(dataset) / plan.unique_prompts)
        total_steps = max(1, cycles) * sum(s.optimizer_update for s in plan.cycle(0))
    rewards = reward_runner(cfg, reg, given.rewards, task)
    guard = RunGuard(cfg, rewards.names, reg, generator.memory_advice)
    scheduler = make_scheduler(cfg, policy.optimizer, total_steps)
    compiled = policy.compiled_layers
    trained = Policy(
        policy.model, policy.unwrapped, policy.ref_model, policy.is_peft, functools.partial(training_passes, compiled),
        compiled.chunk_logps if compiled is not None else None,
        multiple=math.lcm(8 if compiled is not None else 1, cfg.pad_to_multiple_of or 1),
        min_pass_tokens=host_bound_tokens(policy.unwrapped, acc.device),
        max_pass_tokens=cfg.train_pass_tokens if cfg.train_pass_tokens != "auto" else None,
    )
    if cfg.train_pass_tokens == "auto" and cfg.fsdp is None:  # fsdp: every process the same passes (by rows)
        trained.pass_budget = PassBudget(
            policy.unwrapped, policy.trainable, policy.optimizer, acc.device, cfg.gradient_checkpointing,
            offload=cfg.activation_offload, compiled=compiled is not None,
        ).tokens
        guard.pass_tokens = lambda: trained.pass_tokens() if trained.pass_tokens_known else None
    prompts = PromptSource(
        dataset, prompt_column, environment, PromptStream(len(dataset), cfg.seed, cfg.shuffle_dataset),
        cfg.max_prompt_length, cfg.prompt_truncation, images,
    )
    if images is not None:
        trained.images = prompts.inputs
    advantages_of = functools.partial(
        compute_advantages, num_generations=plan.num_generations, reward_weights=rewards.weights,
        scale_rewards=resolve_component("reward_scaling", cfg.scale_rewards, reg),
        multi_objective_aggregation=cfg.multi_objective_aggregation, registry=reg,
    )
    group_filter = resolve_component("group_filter", cfg.group_filter, reg) if cfg.group_filter is not None else None
    rollouts = RolloutMaker(cfg, acc, plan, trained, prompts, environment, rewards, guard, advantages_of, group_filter)
    update = PolicyUpdate(
        cfg, acc, plan, trained, policy.trainable, policy.optimizer, scheduler, Objective.from_config(cfg, reg), guard,
        policy.master,
    )
    evaluator, eval_every = None, 0
    if cfg.eval_strategy == "steps":
        eval_prompts = load_eval_prompts(cfg, reg, tokenizer, given.eval_dataset, task, trains_on_task=given.dataset is None)
        evaluator = Evaluator(cfg, environment, rewards, eval_prompts, acc)
        eval_every = cfg.resolved_eval_steps(total_steps)
    # Sampling differs per process (each generates different completions), so seed by rank.
    set_seed(cfg.seed + acc.process_index)
    return RunParts(
        accelerator=acc, plan=plan, policy=policy, scheduler=scheduler, generator=generator,
        environment=environment, dataset=dataset, prompt_column=prompt_column, task=task, rewards=rewards,
        guard=guard, total_steps=total_steps, rollouts=rollouts, update=update, evaluator=evaluator,
        eval_every=eval_every, compiles=compiles, own_process_group=own_process_group, compile_cache=compile_cache,
    )


def _compile_settings(config: GRPOConfig, policy: TrainedModel, generator: Any) -> dict[str, Any]:
    """What besides the model and torch shapes the compiled graphs (the compile cache's key)."""
    params = next(policy.unwrapped.parameters(), None)
    return {
        "dtype": str(params.dtype) if params is not None else None,
        "compile_layers": policy.compiled_layers is not None,
        "generator": repr(getattr(generator, "params", type(generator).__name__)),
        "gradient_checkpointing": config.gradient_checkpointing,
        "attn_implementation": getattr(policy.unwrapped.config, "_attn_implementation", None),
    }
