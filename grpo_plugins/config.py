"""The run configuration: one flat pydantic model, loaded from YAML, overridable with ``--set``.

Every parameter of the source document is accepted under its own name with its own default, at
the top level (as in TRL's ``GRPOConfig``). Component choices (``loss_type``, ``rewards``, ...)
are names looked up in the registry; each may also be written as ``{name: ..., params: {...}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DType = Literal["auto", "bfloat16", "float16", "float32"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ComponentRef(_Strict):
    """A component named in the config: ``name`` (or ``distribution:name``) plus its params."""

    name: str = Field(description="Registered name, or 'distribution:name' to pick one of two.")
    params: dict[str, Any] = Field(default_factory=dict, description="Validated by the component's own params model.")


class RewardSpec(ComponentRef):
    """A reward function and how it counts."""

    weight: float = Field(1.0, description="Weight in the weighted sum of rewards.")
    on_error: Literal["raise", "none"] = Field(
        "raise",
        description="'raise': a failing reward stops the run cleanly; 'none': failures count as None (not applicable).",
    )
    timeout: float | None = Field(None, gt=0, description="Seconds per call before it counts as failed.")
    executor: Literal["thread", "process"] = Field(
        "thread", description="'process' runs it in a worker process (CPU-heavy or untrusted code)."
    )


class LoraSettings(_Strict):
    """LoRA adapter settings (peft). With LoRA and beta > 0 the reference is the base model with
    the adapter disabled; no second copy is loaded."""

    r: int = Field(16, gt=0)
    lora_alpha: int = Field(32, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | str = Field("all-linear", description="Module names, or 'all-linear'.")
    bias: Literal["none", "all", "lora_only"] = "none"


class ModelSpec(_Strict):
    """Where the model comes from: a local directory or hub id, a GGUF file, ``builtin:NAME``, or
    a random initialisation from a transformers config plus a tokenizer path."""

    name_or_path: str | None = Field(None, description="Local dir, hub id (offline when cached), .gguf file or builtin:NAME.")
    config: dict[str, Any] | str | None = Field(None, description="transformers config (dict or JSON path) for a random initialisation.")
    tokenizer: str | None = Field(None, description="Tokenizer path; defaults to name_or_path.")
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("give exactly one of model.name_or_path and model.config")
        if self.config is not None and self.tokenizer is None:
            raise ValueError("model.config (random initialisation) needs model.tokenizer")
        return self


class DatasetSpec(_Strict):
    """A dataset read with ``datasets.load_dataset`` (or ``load_from_disk`` for a saved one)."""

    path: str = Field(description="'json', 'csv', 'parquet' with data_files, a saved dataset directory, or a hub name.")
    name: str | None = None
    data_files: str | list[str] | dict[str, Any] | None = None
    split: str = "train"
    prompt_column: str = Field("prompt", description="Column holding the prompt (text or chat messages).")


class GRPOConfig(_Strict):
    """A GRPO run. Field names and defaults follow TRL's GRPOConfig and Unsloth's RL docs."""

    # -- model and data -------------------------------------------------------------------------
    model: str | ModelSpec = Field("builtin:smollm2-135m-instruct", description="A path/id/builtin:NAME, or a mapping (see ModelSpec).")
    dtype: DType = Field("auto", description="bfloat16, float16 (with loss scaling), float32; auto: bf16 on GPUs that support it, else fp32.")
    lora: LoraSettings | None = Field(None, description="LoRA adapter settings; null trains all weights.")
    gradient_checkpointing: bool = False
    task: str | ComponentRef | None = Field("arithmetic", description="A task component: data plus default rewards.")
    dataset: DatasetSpec | None = Field(None, description="A dataset instead of (or overriding the data of) the task.")
    rewards: list[str | RewardSpec] = Field(default_factory=list, description="Reward names or mappings; empty: the task's defaults.")
    reward_weights: list[float] | None = Field(None, description="One weight per reward; None: each reward's own weight (1.0).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"

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
    vllm_importance_sampling_cap: float = Field(2.0, gt=0, description="TIS cap C.")
    rollout_correction: str | ComponentRef = Field("token_truncate", description="Which correction TIS applies (a plugin name).")

    # -- generation -----------------------------------------------------------------------------
    generator: str | ComponentRef | None = Field(None, description="Generation backend; None: vllm with fast_inference, else transformers.")
    fast_inference: bool = Field(False, description="Use the vLLM backend (needs vllm installed).")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1, description="Must be in (0, 1].")
    top_k: int | None = Field(None, ge=1, description="None disables top-k filtering.")
    min_p: float | None = Field(None, ge=0, le=1, description="In [0, 1]; None disables.")
    repetition_penalty: float = Field(1.0, gt=0)
    max_completion_length: int = Field(256, ge=1)
    max_prompt_length: int | None = Field(512, ge=1)
    prompt_truncation: Literal["error", "left"] = Field("error", description="Prompts over max_prompt_length: reject, or keep the last tokens.")

    # -- batching -------------------------------------------------------------------------------
    per_device_train_batch_size: int = Field(8, ge=1, description="Completions per process per micro-step (alias train_batch_size).")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer update (alias gradient_accumulation).")
    steps_per_generation: int | None = Field(None, ge=1, description="Micro-steps per generation; None: gradient_accumulation_steps.")
    generation_batch_size: int | None = Field(None, ge=1, description="Completions per generation over all processes (instead of steps_per_generation).")
    num_generations: int = Field(8, ge=2, description="Completions per prompt (G); at least 2.")
    num_processes: int | None = Field(None, ge=1, description="Override the process count (plan/validate); default: from accelerate.")

    # -- optimisation ---------------------------------------------------------------------------
    learning_rate: float = Field(1e-6, gt=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup", "cosine_with_min_lr"] = "linear"
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient-norm clipping; None disables.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; None: num_train_epochs over the data.")
    num_train_epochs: float = Field(1.0, gt=0)
    seed: int = 42
    logprob_chunk_size: int = Field(1024, ge=1, description="Rows x tokens per chunk of the chunked log-softmax.")

    # -- output ---------------------------------------------------------------------------------
    output_dir: str = "outputs/grpo"
    logging_steps: int = Field(1, ge=1)
    save_steps: int | None = Field(None, ge=1, description="Checkpoint every N optimizer steps (and always at the end).")
    save_total_limit: int | None = Field(2, ge=1, description="Checkpoints kept; None keeps all.")
    report_to: list[Literal["jsonl", "tensorboard"]] = Field(default_factory=lambda: ["jsonl", "tensorboard"])
    log_completions: bool = Field(False, description="Write sampled completions to completions.jsonl.")
    on_nonfinite: Literal["skip", "stop"] = Field("stop", description="A NaN/inf loss or gradient: skip the step, or stop.")
    disable_plugins: list[str] = Field(default_factory=list, description="Distributions whose plugins are not loaded.")

    # -- aliases and normalisation --------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, name in (("train_batch_size", "per_device_train_batch_size"), ("gradient_accumulation", "gradient_accumulation_steps")):
            if alias in data:
                if name in data and data[name] != data[alias]:
                    raise ValueError(f"{alias} is an alias of {name}; give only one of them")
                data[name] = data.pop(alias)
        model = data.get("model")
        if isinstance(model, dict):  # model: {name_or_path, dtype, lora, gradient_checkpointing}
            model = dict(model)
            for key in ("dtype", "lora", "gradient_checkpointing"):
                if key in model:
                    if key in data:
                        raise ValueError(f"give {key} either at the top level or under model, not both")
                    data[key] = model.pop(key)
            data["model"] = model
        return data

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_alias(cls, value: Any) -> Any:
        if value is True:
            return "group"
        if value is False:
            return "none"
        return value

    @model_validator(mode="after")
    def _batching(self) -> GRPOConfig:
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError(
                "steps_per_generation and generation_batch_size are mutually exclusive; set only one"
            )
        return self

    # -- resolved values ----------------------------------------------------------------------------

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def component_ref(value: str | ComponentRef | bool | None) -> ComponentRef | None:
    """Normalise a component field (a bare name or a mapping) to a ComponentRef."""
    if value is None:
        return None
    if isinstance(value, ComponentRef):
        return value
    return ComponentRef(name=str(value))
