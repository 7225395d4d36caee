"""The sections of a run config: the pydantic models that :class:`~grpo_plugins.config.GRPOConfig`
nests (a component named with its params, a reward, the model, LoRA, FSDP, a dataset)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "bfloat16", "float16", "float32"]


class StrictModel(BaseModel):
    """A config section: unknown keys and NaN/inf numbers are errors; assignments are validated."""

    # NaN/inf in a number field (YAML's .nan/.inf) is never meant: reject it where it is written.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ComponentRef(StrictModel):
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


class LoraSettings(StrictModel):
    """LoRA adapter settings (peft). With LoRA and beta > 0 the reference is the base model with
    the adapter disabled; no second copy is loaded."""

    r: int = Field(16, gt=0, description="Rank of the adapter matrices.")
    lora_alpha: int = Field(32, gt=0, description="Scaling: the update is multiplied by lora_alpha / r.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] | str = Field("all-linear", description="Module names, or 'all-linear'.")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases are trained.")
    dtype: Literal["float32", "model"] = Field(
        "float32",
        description="The adapters' storage and compute dtype: float32 (peft's default: every adapter product casts its input to float32) or model (the model's dtype, e.g. bfloat16: the adapter products run in 16 bits on the tensor cores, and the optimizer keeps float32 master copies of the adapters as for 16-bit full fine-tuning, unless master_weights: false).",
    )


class FSDPSettings(StrictModel):
    """FSDP (torch's FSDP2, ``fully_shard``): full fine-tuning with the weights, gradients and
    optimizer state sharded over the processes (docs/engine.md, "Several GPUs")."""

    reshard_after_forward: bool = Field(
        True,
        description="Free each layer's gathered weights after its forward and gather them again for backward (ZeRO-3); false keeps them until backward (more memory, fewer all-gathers).",
    )
    layer_classes: list[str] | None = Field(
        None,
        description="Class names of the modules sharded one by one (the decoder layers); None: the model's _no_split_modules (e.g. LlamaDecoderLayer).",
    )


class ModelSpec(StrictModel):
    """Where the model comes from: a local directory or hub id, a GGUF file, ``builtin:NAME``, or
    a random initialisation from a transformers config plus a tokenizer path."""

    name_or_path: str | None = Field(None, description="Local dir, hub id (offline when cached), .gguf file or builtin:NAME.")
    config: dict[str, Any] | str | None = Field(None, description="transformers config (dict or JSON path) for a random initialisation.")
    tokenizer: str | None = Field(None, description="Tokenizer path; defaults to name_or_path.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a cached model.")
    trust_remote_code: bool = Field(False, description="Allow model code shipped with the checkpoint.")
    attn_implementation: str | None = Field(None, description="transformers attention backend (eager, sdpa, flash_attention_2); None: its default.")
    init_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More keyword arguments for from_pretrained (TRL's model_init_kwargs other than dtype, attn_implementation, revision, trust_remote_code).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("give exactly one of model.name_or_path and model.config")
        if self.config is not None and self.tokenizer is None:
            raise ValueError("model.config (random initialisation) needs model.tokenizer")
        return self


class DatasetSpec(StrictModel):
    """A dataset read with ``datasets.load_dataset`` (or ``load_from_disk`` for a saved one)."""

    path: str = Field(description="'json', 'csv', 'parquet' with data_files, a saved dataset directory, or a hub name.")
    name: str | None = Field(None, description="Dataset configuration name.")
    data_files: str | list[str] | dict[str, Any] | None = Field(None, description="Files for the json/csv/parquet builders.")
    split: str = Field("train", description="Split to train on.")
    prompt_column: str = Field("prompt", description="Column holding the prompt (text or chat messages).")


def component_ref(value: str | ComponentRef | bool | None) -> ComponentRef | None:
    """Normalise a component field (a bare name or a mapping) to a ComponentRef."""
    if value is None:
        return None
    if isinstance(value, ComponentRef):
        return value
    return ComponentRef(name=str(value))
