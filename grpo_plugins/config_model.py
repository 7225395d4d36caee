"""The run configuration: one flat pydantic model, :class:`GRPOConfig`, with its validators and
resolved values (loading it from YAML with ``--set`` overrides: :mod:`grpo_plugins.config`).

Every parameter of the source document is accepted under its own name with its own default, at
the top level (as in TRL's ``GRPOConfig``). Component choices (``loss_type``, ``rewards``, ...)
are names looked up in the registry; each may also be written as ``{name: ..., params: {...}}``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_plugins.config_errors import FieldError
from grpo_plugins.config_specs import (
    ComponentRef,
    DatasetSpec,
    DType,
    FSDPSettings,
    LoraSettings,
    ModelSpec,
    RewardSpec,
    StrictModel,
    component_ref,
)
from grpo_plugins.trl_compat import log_notes, translate_trl_keys


class GRPOConfig(StrictModel):
    """A GRPO run. Field names and defaults follow TRL's GRPOConfig and Unsloth's RL docs."""

    # -- model and data -------------------------------------------------------------------------
    model: str | ModelSpec = Field("builtin:smollm2-135m-instruct", description="A path/id/builtin:NAME, or a mapping (see ModelSpec).")
    dtype: DType = Field("auto", description="bfloat16, float16 (with loss scaling), float32; auto: bf16 on GPUs that support it, else fp32.")
    lora: LoraSettings | None = Field(None, description="LoRA adapter settings; null trains all weights.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less memory, more time.")
    train_vision_tower: bool = Field(
        False,
        description="A vision-language model: also train its vision encoder and projector (LoRA adapters on them too with lora); false keeps them frozen and trains the language model only.",
    )
    disable_dropout: bool = Field(False, description="Set every dropout probability of the model (and of LoRA adapters) to 0, as TRL does.")
    cast_lm_head_to_fp32: bool = Field(
        False, description="Keep the LM head's weights in float32 and compute the logits in float32 (ScaleRL); not with LoRA on the head."
    )
    activation_offload: bool = Field(
        False,
        description="With gradient_checkpointing: keep each checkpointed layer's input hidden states in (pinned) CPU memory instead of on the device, copied back for the backward pass (Unsloth's offloaded checkpointing). Frees layers x tokens x hidden x 2 bytes of device memory per forward; costs two host-device copies per layer.",
    )
    load_in_4bit: bool = Field(
        False,
        description="QLoRA: quantise the base model's linear layers to 4-bit NF4 with bitsandbytes (needs lora, a CUDA device and `pip install 'grpo-plugins[qlora]'`); the LoRA adapters and the LM head stay in 16/32 bits.",
    )
    load_in_8bit: bool = Field(
        False,
        description="Like load_in_4bit, with 8-bit (LLM.int8) base weights.",
    )
    load_in_fp8: bool = Field(
        False,
        description="LoRA on a float8 base: the frozen linear layers (not the LM head) hold float8 (e4m3) weights with one scale per output channel and multiply in float8 forward and backward, their inputs quantised per row (torch._scaled_mm; GPUs with float8 tensor cores: Ada, Hopper; dtype bfloat16 on a GPU). The trained policy is the float8 model; the static generator's merged decode copies then sample a close neighbour of it, so vllm_importance_sampling_correction: auto turns the rollout correction on. Needs lora; export merges into the original 16-bit base. Check it against a bf16 run: on a 135M model it kept the policy from learning (float8 weights turned its gradient; bench/fp8_gradients.py measures that for a model).",
    )
    task: str | ComponentRef | None = Field("arithmetic", description="A task component: data plus default rewards.")
    dataset: DatasetSpec | None = Field(None, description="A dataset instead of (or overriding the data of) the task.")
    rewards: list[str | RewardSpec] = Field(default_factory=list, description="Reward names or mappings; empty: the task's defaults.")
    reward_weights: list[float] | None = Field(None, description="One weight per reward; None: each reward's own weight (1.0).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="sum_then_normalize: weighted sum of rewards, then scaling; normalize_then_sum (GDPO): normalise each reward per group first."
    )

    # -- objective ------------------------------------------------------------------------------
    beta: float = Field(0.0, ge=0, description="KL coefficient; 0 loads no reference model.")
    num_iterations: int = Field(1, ge=1, description="mu: optimisation passes over each generation batch.")
    epsilon: float = Field(0.2, gt=0, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip: ratio <= 1 + epsilon_high; None: epsilon.")
    delta: float | None = Field(None, gt=1, description="Two-sided GRPO: cap the unclipped ratio at delta (> 1 + epsilon recommended).")
    importance_sampling_level: str | ComponentRef = Field("token", description="'token' or 'sequence' (GSPO), or a plugin.")
    scale_rewards: bool | str | ComponentRef = Field("group", description="group/True, batch, none/False, or a plugin.")
    loss_type: str | ComponentRef = Field("dapo", description="grpo, dr_grpo, dapo, bnpo, cispo, sapo, or a plugin.")
    mask_truncated_completions: bool = Field(False, description="Exclude completions that hit max_completion_length from the loss.")
    vllm_importance_sampling_correction: bool | Literal["auto"] = Field(
        "auto", description="Truncated importance sampling; auto: on when the generator is not the trained model itself."
    )
    vllm_importance_sampling_cap: float | None = Field(2.0, gt=0, description="TIS cap C (upper bound of the ratio); None: no upper bound (mask variants with a clip_min).")
    rollout_correction: str | ComponentRef = Field("token_truncate", description="Which correction TIS applies (a plugin name).")
    use_bias_correction_kl: bool = Field(
        False, description="Multiply the KL term by the importance ratio (DeepSeek-V3.2's unbiased KL gradient). TRL 1.16 defaults to true; false keeps the plain k3 term."
    )
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, description="Drop sequences with negative advantage whose mean KL(sampler || policy) exceeds this (DeepSeek-V3.2); 0 drops every such sequence whose sampler was more confident than the policy; None: off."
    )
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="Train the policy term only on the top quantile of tokens by entropy (Beyond the 80/20 Rule recommends 0.2); 1.0 keeps all."
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus: loss -= entropy_coef x mean token entropy; the start value with use_adaptive_entropy.")
    use_adaptive_entropy: bool = Field(
        False, description="Skywork-OR1's control: after each optimizer step entropy_coef rises by entropy_coef_delta when the entropy is at or below entropy_target, else falls; applied only while the entropy is at or below the target."
    )
    entropy_coef_min: float = Field(0.0, description="Lower bound of the adaptive entropy coefficient.")
    entropy_coef_max: float = Field(1.0, description="Upper bound of the adaptive entropy coefficient.")
    entropy_coef_delta: float = Field(0.005, ge=0, description="Step of the adaptive entropy coefficient.")
    entropy_target: float = Field(0.2, description="Target mean token entropy (nats) of adaptive entropy control.")
    sync_ref_model: bool = Field(
        False, description="Every ref_model_sync_steps optimizer steps, mix the policy into the reference: ref = alpha x policy + (1 - alpha) x ref (TR-DPO). Needs beta > 0."
    )
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1, description="alpha of sync_ref_model.")
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs (sync_ref_model).")

    # -- generation -----------------------------------------------------------------------------
    generator: str | ComponentRef | None = Field(None, description="Generation backend; None: vllm with fast_inference, else static (transformers for a vision-language model and with generation_kwargs; static itself falls back to transformers for a model it cannot run).")
    fast_inference: bool = Field(False, description="Use the vLLM backend (needs vllm installed).")
    environment: str | ComponentRef = Field(
        "single_turn",
        description="What a rollout is: single_turn (one completion per prompt), tool_calling (multi-turn with tools, see docs/environments.md), or a plugin.",
    )
    generate_ahead: bool = Field(
        False, description="Generate the next batch while this one trains (a thread beside the training pass, before the optimizer step): its completions come from the policy one optimizer step older, which the rollout correction (on with vllm_importance_sampling_correction: auto) weighs back. Pays where the generator decodes on GPUs of its own (vllm in server mode); on one GPU the decode barely advances beside a training pass (0.5B: 2%). Needs a generator and environment that can run beside training (vllm server mode, or static with merged weights; single_turn; others generate before training, warned), no group filter that drops groups, no dropout.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (> 0); keep it high (1.0) for diverse groups. Log-probs use the same temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Must be in (0, 1].")
    top_k: int | None = Field(None, ge=1, description="None disables top-k filtering.")
    min_p: float | None = Field(None, ge=0, le=1, description="In [0, 1]; None disables.")
    repetition_penalty: float = Field(1.0, gt=0, description="> 1 discourages tokens already in the prompt or completion, < 1 encourages them.")
    max_completion_length: int = Field(256, ge=1, description="Most tokens generated per completion; longer ones are truncated.")
    max_prompt_length: int | None = Field(512, ge=1, description="Most prompt tokens (see prompt_truncation); None: no limit.")
    prompt_truncation: Literal["error", "left"] = Field("error", description="Prompts over max_prompt_length: reject, or keep the last tokens.")
    generation_kwargs: dict[str, Any] | None = Field(
        None, description="More sampling arguments for the generator (transformers: GenerationConfig; vllm: SamplingParams); they override the ones above. Not with the static generator: with them the default generator is transformers."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Keyword arguments for the tokenizer's apply_chat_template on chat prompts (e.g. {enable_thinking: false})."
    )
    pad_to_multiple_of: int | None = Field(
        None, ge=1, description="Pad each training and log-prob input (prompt + completion) to a multiple of this many tokens; None: no extra padding."
    )

    # -- batching -------------------------------------------------------------------------------
    per_device_train_batch_size: int = Field(8, ge=1, description="Completions per process per micro-step (alias train_batch_size).")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer update (alias gradient_accumulation).")
    steps_per_generation: int | None = Field(None, ge=1, description="Micro-steps per generation; None: gradient_accumulation_steps.")
    generation_batch_size: int | None = Field(None, ge=1, description="Completions per generation over all processes (instead of steps_per_generation; both may be given when they agree, as TRL's GRPOConfig fills in both).")
    num_generations: int = Field(8, description="Completions per prompt (G); at least 2.")
    num_processes: int | None = Field(None, ge=1, description="Override the process count (plan/validate); default: from accelerate.")
    fsdp: FSDPSettings | None = Field(
        None,
        description="Shard weights, gradients and optimizer state over the processes (FSDP2) for full fine-tuning; true or a mapping of FSDPSettings. None: every process holds the whole model (DDP on several processes).",
    )
    shuffle_dataset: bool = Field(True, description="Shuffle the prompts (a fresh seeded order each epoch); false: dataset order.")
    group_filter: str | ComponentRef | None = Field(
        None,
        description="Dynamic sampling (DAPO): which generated groups are trained on, a group_filter plugin: drop_zero_std, accuracy_band, keep_all. A filter that drops groups makes the engine generate more prompts until the batch is full. None: every group, as keep_all.",
    )
    max_refill_rounds: int = Field(
        4,
        ge=0,
        description="With a group_filter that drops groups: most extra generation rounds (of unique_prompts new prompts each) per cycle; when still short, the kept groups are trained on and the empty slots masked out (metric group_filter/cap_hit).",
    )

    # -- optimisation ---------------------------------------------------------------------------
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "linear", description="Learning-rate schedule after warmup (transformers' schedulers)."
    )
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Fraction of the optimizer steps spent warming up (when warmup_steps is 0).")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup; overrides warmup_ratio when > 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    master_weights: bool | None = Field(
        None,
        description="The optimizer steps float32 copies of 16-bit (bf16/fp16) trainable weights and writes them back rounded, so small updates are not lost. None: on whenever trainable weights are 16-bit (full fine-tuning in bf16, or LoRA with lora.dtype: model); LoRA adapters are float32 by default.",
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient-norm clipping; None disables.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; None: num_train_epochs over the data.")
    num_train_epochs: float = Field(1.0, gt=0, description="Passes over the prompts when max_steps is None.")
    seed: int = Field(42, description="Seed for data order, sampling and initialisation.")
    logprob_chunk_size: int = Field(1024, ge=1, description="Rows x tokens per chunk of the chunked log-softmax.")
    compile_layers: bool | None = Field(
        None,
        description="torch.compile each decoder layer's forward for the training and log-prob passes (fewer, fused kernels; compiles on the first steps). None: on when training on CUDA (full fine-tuning and LoRA), off over a quantized (4/8-bit) base and on a CPU; the first steps pay the compilation (about 1-2 minutes on an H200; docs/performance.md).",
    )
    train_chunk_rows: int | None = Field(
        None,
        ge=1,
        description="Rows per forward+backward inside a micro-step (and per old/reference log-prob forward); the gradient equals the whole micro-batch's. Less activation memory; None: the whole micro-batch at once.",
    )
    train_pass_tokens: int | Literal["auto"] | None = Field(
        "auto",
        description="At most this many tokens (rows x the pass's padded length) per forward+backward inside a micro-step (and per old/reference log-prob forward); the gradient equals the whole micro-batch's. With group_by_length a pass of short completions holds more rows than one of long ones, so it bounds activation memory where train_chunk_rows would bound rows (e.g. 8192 for a 7B model without gradient checkpointing on an H200). A row longer than it still gets a pass. auto: on CUDA, sized once at the first pass from the device memory left and the model's activations per token (with and without gradient_checkpointing), so a micro-batch that would not fit is split instead of running out of memory; no limit on a CPU and with fsdp. None: no limit. Not a number with fsdp (every process must make the same passes).",
    )
    group_by_length: bool = Field(
        True,
        description="Sort a micro-step's rows by length and split them where that saves padding (at most train_chunk_rows rows a pass), each pass cut to its own longest row: a training pass costs about its real tokens, not rows x the longest completion. Same loss and gradient up to float rounding. Off with top_entropy_quantile < 1 (its quantile is per pass) and with fsdp (every process must make the same passes).",
    )

    # -- evaluation -----------------------------------------------------------------------------
    eval_dataset: DatasetSpec | None = Field(None, description="Prompts to evaluate on (grpo-plugins eval, and during training); None: the task's held-out split.")
    eval_strategy: Literal["no", "steps"] = Field("no", description="TRL's name: 'steps' evaluates during training every eval_steps optimizer steps; 'no' never.")
    eval_steps: float | None = Field(None, gt=0, description="Evaluate every N optimizer steps (with eval_strategy: steps); a value below 1 is a fraction of the run's steps; None: logging_steps.")
    eval_on_start: bool = Field(False, description="Also evaluate before the first optimizer step (logged as step 0), with eval_strategy: steps.")
    num_generations_eval: int | None = Field(None, ge=1, description="Samples per eval prompt (n of pass@k); None: num_generations.")
    per_device_eval_batch_size: int = Field(8, ge=1, description="Completions generated at once per process when evaluating.")

    # -- output ---------------------------------------------------------------------------------
    output_dir: str = Field("outputs/grpo", description="Where metrics.jsonl, TensorBoard events, checkpoints and config.yaml go.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")
    save_steps: int | None = Field(None, ge=1, description="Checkpoint every N optimizer steps (and always at the end).")
    save_total_limit: int | None = Field(2, ge=1, description="Checkpoints kept; None keeps all.")
    report_to: list[Literal["jsonl", "tensorboard"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"], description="Metric sinks besides the console."
    )
    log_completions: bool = Field(False, description="Write sampled completions to completions.jsonl.")
    num_completions_to_print: int | None = Field(
        None, ge=0, description="With log_completions: also print this many completions (prompt, completion, rewards, advantage) of each generation batch on stderr; None: none printed (TRL: all)."
    )
    log_unique_prompts: bool = Field(False, description="With log_completions: print one completion per prompt only.")
    on_nonfinite: Literal["skip", "stop"] = Field("stop", description="A NaN/inf reward, advantage, loss or gradient: skip that optimizer step, or stop naming the step and the component (docs/failures.md).")
    disable_plugins: list[str] = Field(default_factory=list, description="Distributions whose plugins are not loaded.")

    # -- aliases and normalisation --------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data, notes = translate_trl_keys(data, set(cls.model_fields))  # TRL GRPOConfig keys -> this project's form
        log_notes(notes)
        for alias, name in (("train_batch_size", "per_device_train_batch_size"), ("gradient_accumulation", "gradient_accumulation_steps")):
            if alias in data:
                if name in data and data[name] != data[alias]:
                    raise FieldError(alias, f"{alias} is an alias of {name}; give only one of them")
                data[name] = data.pop(alias)
        model = data.get("model")
        if isinstance(model, dict):  # model: {name_or_path, dtype, lora, gradient_checkpointing, load_in_4bit, ...}
            model = dict(model)
            for key in ("dtype", "lora", "gradient_checkpointing", "activation_offload", "load_in_4bit", "load_in_8bit", "load_in_fp8"):
                if key in model:
                    if key in data:
                        raise FieldError(f"model.{key}", f"give {key} either at the top level or under model, not both")
                    data[key] = model.pop(key)
            data["model"] = model
        return data

    @model_validator(mode="after")
    def _memory_settings(self) -> GRPOConfig:
        if self.activation_offload and not self.gradient_checkpointing:
            raise FieldError(
                "activation_offload",
                "activation_offload offloads the inputs of checkpointed layers; set gradient_checkpointing: true too",
            )
        if self.load_in_4bit and self.load_in_8bit:
            raise FieldError("load_in_8bit", "load_in_4bit and load_in_8bit are mutually exclusive; set only one")
        if (self.load_in_4bit or self.load_in_8bit) and self.lora is None:
            key = "load_in_4bit" if self.load_in_4bit else "load_in_8bit"
            raise FieldError(
                key, f"{key} quantises the frozen base, which only LoRA can train: add lora: {{r: 16}} (QLoRA)"
            )
        if self.load_in_fp8 and self.lora is None:
            raise FieldError("load_in_fp8", "load_in_fp8 puts the frozen base in float8, which only LoRA can train: add lora: {r: 16}")
        if self.load_in_fp8 and self.quantization_bits is not None:
            key = "load_in_4bit" if self.load_in_4bit else "load_in_8bit"
            raise FieldError("load_in_fp8", f"load_in_fp8 and {key} both quantise the base; set only one")
        generator = component_ref(self.resolved_generator)
        if self.load_in_fp8 and generator is not None and generator.name.rsplit(":", 1)[-1] == "vllm":
            raise FieldError(
                "load_in_fp8",
                "the vllm generator cannot take weights from a float8 base yet; set fast_inference: false "
                "(the static generator decodes it; its own fp8: true param decodes in float8 too)",
            )
        if self.quantization_bits is not None and generator is not None and generator.name.rsplit(":", 1)[-1] == "vllm":
            raise FieldError(
                "load_in_4bit" if self.load_in_4bit else "load_in_8bit",
                "the vllm generator cannot take weights from a bitsandbytes-quantised base yet; "
                "set fast_inference: false (the static generator samples from the quantised model itself)",
            )
        return self

    @property
    def quantization_bits(self) -> int | None:
        """4 or 8 when the base is quantised (``load_in_4bit`` / ``load_in_8bit``), else None."""
        return 4 if self.load_in_4bit else 8 if self.load_in_8bit else None

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_alias(cls, value: Any) -> Any:
        if value is True:
            return "group"
        if value is False:
            return "none"
        return value

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_shorthand(cls, value: Any) -> Any:
        if value is True:
            return {}
        if value is False:
            return None
        if isinstance(value, (str, list)):
            raise ValueError(
                "takes true or a mapping {reshard_after_forward, layer_classes}; TRL's "
                "fsdp: 'full_shard auto_wrap' is fsdp: true here"
            )
        return value

    @model_validator(mode="after")
    def _fsdp(self) -> GRPOConfig:
        if self.fsdp is None:
            return self
        refusals = [
            ("lora", self.lora is not None, "FSDP shards full fine-tuning; LoRA's adapters are small, so train them with DDP (remove fsdp) or set lora: null"),
            ("dtype", self.dtype == "float16", "FSDP does not support float16's gradient scaler here; use bfloat16 (or float32)"),
            ("cast_lm_head_to_fp32", self.cast_lm_head_to_fp32, "the sharded root (embeddings, LM head) is gathered in one dtype; remove cast_lm_head_to_fp32"),
            ("compile_layers", self.compile_layers is True, "compile_layers is not supported with fsdp yet; remove it (the default is off under fsdp)"),
            ("train_pass_tokens", isinstance(self.train_pass_tokens, int),
             "every process must make the same passes, and a token bound splits each process's rows by its own longest; bound the passes with train_chunk_rows instead"),
        ]
        generator = component_ref(self.resolved_generator)
        refusals.append(
            ("generator" if self.generator is not None else "fast_inference",
             generator is not None and generator.name.rsplit(":", 1)[-1] == "vllm",
             "the vllm generator does not take weights from an FSDP-sharded model yet; use the static generator (fast_inference: false)")
        )
        for field, bad, message in refusals:
            if bad:
                raise FieldError(field, f"with fsdp: {message}")
        return self

    @model_validator(mode="after")
    def _objective(self) -> GRPOConfig:
        if self.sync_ref_model and self.beta == 0.0:
            raise FieldError(
                "sync_ref_model",
                "sync_ref_model needs beta > 0: with beta 0 no reference model is loaded, so there is nothing to sync",
            )
        if self.sync_ref_model and self.lora is not None:
            raise FieldError(
                "sync_ref_model",
                "sync_ref_model does not work with LoRA: the reference is the base model with the adapter disabled, "
                "so there is no separate reference to mix the policy into (TRL refuses this too). Train all weights "
                "(lora: null) or set sync_ref_model: false",
            )
        if self.generate_ahead and self.lora is not None and self.lora.lora_dropout > 0:
            raise FieldError("generate_ahead", "the next batch samples from the random stream the training pass's LoRA dropout draws from; set lora.lora_dropout: 0")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise FieldError("entropy_coef_min", "entropy_coef_min must not exceed entropy_coef_max")
        return self

    @model_validator(mode="after")
    def _batching(self) -> GRPOConfig:
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            # TRL's GRPOConfig fills in both (one derived from the other); accept that pair.
            processes = self.num_processes or int(os.environ.get("WORLD_SIZE", "1") or 1)
            if self.generation_batch_size == self.steps_per_generation * self.per_device_train_batch_size * processes:
                object.__setattr__(self, "generation_batch_size", None)
                return self
            raise FieldError(
                "generation_batch_size",
                "steps_per_generation and generation_batch_size are mutually exclusive; set only one",
            )
        return self

    @model_validator(mode="after")
    def _eval_steps(self) -> GRPOConfig:
        if self.eval_steps is not None and self.eval_steps > 1 and self.eval_steps != int(self.eval_steps):
            raise FieldError("eval_steps", f"must be a whole number of steps, or a fraction below 1 of the run's steps; got {self.eval_steps}")
        return self

    @field_validator("num_generations")
    @classmethod
    def _at_least_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"must be at least 2 (GRPO compares the completions of a prompt with each other), "
                f"got {value}; 8 is typical"
            )
        return value

    # -- resolved values ----------------------------------------------------------------------------

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def resolved_num_generations_eval(self) -> int:
        return self.num_generations if self.num_generations_eval is None else self.num_generations_eval

    def resolved_eval_steps(self, total_steps: int) -> int:
        """Optimizer steps between evaluations: ``eval_steps`` (a fraction of ``total_steps``
        when below 1, rounded up as TRL does), else ``logging_steps``."""
        if self.eval_steps is None:
            return self.logging_steps
        if self.eval_steps < 1:
            return max(1, math.ceil(self.eval_steps * total_steps))
        return int(self.eval_steps)

    @property
    def resolved_generator(self) -> str | ComponentRef:
        """The generation backend as far as the config decides it: ``generator``, else vllm with
        fast_inference, else transformers (the engine picks ``static`` instead unless the model is a
        vision-language model or generation_kwargs are set; see
        :func:`grpo_plugins.generators.generator_ref`)."""
        if self.generator is not None:
            return self.generator
        return "vllm" if self.fast_inference else "transformers"

    def to_yaml(self) -> str:
        """The config as YAML, every field included (what a run writes to its output dir)."""
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


#: Headings for docs/config.md: the first field of each group of GRPOConfig -> its heading.
CONFIG_SECTIONS: dict[str, str] = {
    "model": "Model and data",
    "beta": "Objective",
    "generator": "Generation",
    "per_device_train_batch_size": "Batching",
    "learning_rate": "Optimisation",
    "eval_dataset": "Evaluation",
    "output_dir": "Output and plugins",
}


#: Config fields that name a single component, and the kind each one names (``rewards``, a
#: list, is checked on its own by grpo_plugins.validation; tools by the environment that takes
#: them). The task comes first: its default rewards are checked when the config lists none.
COMPONENT_FIELDS: dict[str, str] = {
    "task": "task",
    "loss_type": "loss_type",
    "importance_sampling_level": "importance_sampling",
    "scale_rewards": "reward_scaling",
    "rollout_correction": "rollout_correction",
    "generator": "generator",
    "group_filter": "group_filter",
    "environment": "environment",
}
