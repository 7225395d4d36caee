"""The ``vllm`` generator's params (engine construction, weight sync, sleep mode, server mode)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


#: vLLM keeps per-request seeds in an int64 array (``SamplingStates.seeds`` of its model runner
#: V2, the default for dense models in 0.26), so a seed of 2**63 or more raises OverflowError.
SEED_LIMIT = 2**63 - 1


class VLLMGeneratorParams(BaseModel):
    """Parameters of the ``vllm`` generator (engine construction, weight sync, sleep mode)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: an engine in each training process. server: generation by a separate "
        "`vllm serve` (other GPUs or another machine), weights sent to it after each step (docs/vllm.md).",
    )
    server_host: str = Field("127.0.0.1", description="mode server: host of the vLLM server.")
    server_port: int = Field(8000, ge=1, le=65535, description="mode server: HTTP port of the vLLM server.")
    server_model: str | None = Field(
        None, description="mode server: the served model name to request; None: the server's first (/v1/models)."
    )
    server_timeout: float = Field(
        240.0, gt=0, description="mode server: seconds to wait for the server's /health at start-up, and for each request."
    )
    server_weight_transfer: Literal["nccl", "disk"] = Field(
        "nccl",
        description="mode server: how weights reach the server. nccl: broadcast over NCCL (vLLM's weight-transfer "
        "endpoints; the server on other GPUs). disk: a safetensors file in server_weight_dir that the server "
        "reloads (same machine, also the same GPU).",
    )
    server_group_host: str | None = Field(
        None,
        description="mode server, nccl: this machine's address the server's workers connect to (the trainer hosts "
        "the NCCL rendezvous); None: the local address that routes to server_host.",
    )
    server_group_port: int = Field(
        51216, ge=1, le=65535, description="mode server, nccl: port of the NCCL rendezvous, on the trainer's machine."
    )
    server_weight_dir: str | None = Field(
        None, description="mode server, disk: folder the server can read; None: a temporary folder on this machine."
    )
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="GPU memory share of the colocated engine.")
    max_model_len: int | None = Field(None, ge=1, description="Context length; None: vLLM's default for the model.")
    enable_prefix_caching: bool = True
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (slower, less memory).")
    logprobs_mode: str | None = Field(
        "processed_logprobs",
        description="What the returned log-probs mean (vLLM >= 0.10.2). processed_logprobs: after "
        "temperature, penalties and top-k/top-p/min-p truncation, renormalised over the kept tokens, "
        "i.e. the distribution actually sampled from; with truncation on they differ from the "
        "trainer's log-probs, which are over the full vocabulary (TRL makes the same choice). "
        "None: the engine's default (raw_logprobs, before any processing).",
    )
    sync_weights: bool = Field(True, description="Load the policy's weights into the engine after each optimizer step.")
    weight_sync: Literal["auto", "reload_weights", "load_weights"] = Field(
        "auto",
        description="How weights reach the engine. reload_weights: the worker's "
        "reload_weights(weights_iterator=...); load_weights: apply_model(model.load_weights); "
        "auto: reload_weights where the installed vLLM takes an iterator there, else load_weights.",
    )
    enable_sleep_mode: bool = Field(
        False,
        description="Put the engine to sleep after each generation (KV cache freed, weights freed or "
        "offloaded to CPU) and wake it for the next, leaving its GPU memory to the training passes.",
    )
    sleep_level: Literal[1, 2] | None = Field(
        None,
        description="1: weights offloaded to CPU, 2: weights discarded (reloaded by the sync at wake-up). "
        "None: 2 with sync_weights, else 1.",
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for vllm.LLM.")

    @model_validator(mode="after")
    def _check(self) -> VLLMGeneratorParams:
        if self.mode == "server" and self.enable_sleep_mode:
            raise ValueError(
                "enable_sleep_mode is for mode: colocate (a server's memory is its own); set it to false"
            )
        if self.sleep_level == 2 and not self.sync_weights:
            raise ValueError("sleep_level 2 discards the engine's weights, so it needs sync_weights: true")
        return self
