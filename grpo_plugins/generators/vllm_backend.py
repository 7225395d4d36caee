"""The ``vllm`` generation backend: a colocated vLLM engine, written against vLLM's offline API
(``LLM``, ``SamplingParams``, ``LLM.generate`` with token-id prompts, ``LLM.collective_rpc``,
``LLM.sleep`` / ``LLM.wake_up``) and checked against vLLM 0.26.0's source. An earlier version
ran on an H200 with vLLM 0.26.0 (docs/vllm.md says what was verified there); the tests exercise
its own logic against a fake of the API.

Engine weights: the engine starts from the policy's own checkpoint folder when it has one, else
from a clean safetensors checkpoint of the policy written to a temporary folder (the names
:func:`policy_weights` yields: merged LoRA weights under the base model's names, which vLLM's
loader accepts, where peft's ``base_layer`` / ``lora_A`` names are rejected).

Weight sync: after each optimizer step the policy's weights are handed to the engine as a lazy
iterator, through the worker's ``reload_weights(weights_iterator=...)`` (vLLM's weight-update
path, also right for quantized layers) where the installed vLLM has it, else through
``LLM.apply_model(lambda model: model.load_weights(weights))``. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the iterator is consumed in place, never pickled.
The prefix cache is then reset, since cached prompt KV entries were computed with the old weights.

``mode: server`` generates with a separate ``vllm serve`` over HTTP instead and sends it the
weights through a transport (NCCL or a shared folder); the client side is in
:mod:`grpo_plugins.generators.vllm_server`. Seeds, prompt grouping and output conversion are
the same in both modes.

It samples from a copy of the policy in another engine, so ``samples_from_policy`` is False and
``vllm_importance_sampling_correction: auto`` turns truncated importance sampling on. torch and
vllm are imported inside functions.
"""

from __future__ import annotations

import copy
import inspect
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo_plugins.generators import GeneratorUnavailableError
from grpo_plugins.generators.vllm_server import (
    TRANSPORTS,
    ServerClient,
    WeightTransport,
    check_tokenizer,
    generate_on_server,
    reset_prefix_cache,
    served_model,
)
from grpo_plugins.kinds import GenerationOutput, Generator, SamplingSettings

if TYPE_CHECKING:
    from torch import Tensor

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


def _configure_environment() -> None:
    """Environment vLLM reads when it builds the engine; a user's own setting wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: colocated
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and not _importable("flashinfer"):
        # vLLM's top-k/top-p sampler defaults to flashinfer's and the engine fails to build
        # without it; 0 selects vLLM's own sampler.
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # a broken install counts as absent: vLLM would fail on it as well
        return False
    return True


def _import_vllm() -> Any:
    _configure_environment()
    try:
        import vllm
    except ImportError as exc:
        raise GeneratorUnavailableError(
            "the vllm generator (fast_inference: true) needs vLLM, which is not installed here: "
            "pip install 'grpo-plugins[vllm]' on a GPU machine, or set fast_inference: false / "
            "generator: transformers"
        ) from exc
    return vllm


def _reload_takes_iterator() -> bool:
    """Whether the installed vLLM's workers accept ``reload_weights(weights_iterator=...)``
    (older ones only reload from disk)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    try:
        return "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _policy_entries(model: Any) -> Iterator[tuple[str, Tensor, Any]]:
    """(state-dict name, tensor, LoRA layer whose delta is still to be added, or None) of
    ``model``; peft's adapter tensors are skipped."""
    if not hasattr(model, "get_base_model"):
        for name, tensor in model.state_dict().items():
            yield name, tensor, None
        return
    base = model.get_base_model()
    lora_layers = {
        f"{module_name}.base_layer.weight": module
        for module_name, module in base.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        layer = lora_layers.get(name)
        if layer is not None and (getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False)):
            layer = None
        yield name, tensor, layer


def policy_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of ``model`` in transformers naming, produced lazily.

    For a peft model each LoRA-wrapped weight is yielded as ``base + delta`` computed out of
    place (the model is never merged and unmerged, which would drift low-precision base weights
    a little at every sync); adapter tensors are skipped and ``base_layer`` /
    ``modules_to_save`` names mapped back to the base model's.
    """
    import torch

    for name, tensor, layer in _policy_entries(model):
        if layer is not None:
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}):
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        yield _base_name(name), tensor.detach()


def policy_weight_metadata(model: Any) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of each pair :func:`policy_weights` yields, in its order,
    without computing anything (a merged LoRA weight has its base weight's dtype and shape)."""
    return [
        (_base_name(name), str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        for name, tensor, _ in _policy_entries(model)
    ]


def _base_name(name: str) -> str:
    """The base model's name of a peft-wrapped state-dict entry."""
    return name.replace(".base_layer", "").replace(".modules_to_save.default", "")


def _tied_names(model: Any) -> set[str]:
    """State-dict names whose tensor is one seen earlier under another name (tied weights such
    as lm_head = embed_tokens). Read from the model's own tensors, whose addresses are stable."""
    first: set[tuple[int, int, tuple[int, ...]]] = set()
    tied: set[str] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            tied.add(_base_name(name))
        first.add(key)
    return tied


def write_engine_checkpoint(policy: Any, tokenizer: Any, directory: str) -> None:
    """Write the policy as a checkpoint vLLM can start from: ``model.safetensors`` with the
    names :func:`policy_weights` yields (tied weights once), the base model's config (with its
    ``architectures``) and generation config, and the tokenizer. The tensors are gathered in
    CPU memory (one copy of the model) before the file is written."""
    from safetensors.torch import save_file

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    tied = _tied_names(base)  # safetensors refuses tensors that share storage
    tensors = {name: tensor.to("cpu").contiguous() for name, tensor in policy_weights(policy) if name not in tied}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(base.config)
    # vLLM picks its model class by `architectures`, which a model built with from_config lacks.
    config.architectures = getattr(config, "architectures", None) or [type(base).__name__]
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _group_repeats(prompt_ids: list[list[int]]) -> tuple[list[list[int]], int]:
    """(unique prompts, n) when the prompts are runs of equal length n of identical prompts
    (GRPO's groups), else (prompts, 1)."""
    runs: list[list[int]] = []
    sizes: list[int] = []
    for ids in prompt_ids:
        if runs and runs[-1] == ids:
            sizes[-1] += 1
        else:
            runs.append(list(ids))
            sizes.append(1)
    if sizes and len(set(sizes)) == 1 and sizes[0] > 1:
        return runs, sizes[0]
    return [list(p) for p in prompt_ids], 1


def _sampled_logprob(entry: Any, token: int) -> float:
    value = entry[token]
    return float(value.logprob if hasattr(value, "logprob") else value)


def sampled_logprobs(container: Any, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token from a completion's ``logprobs``: vLLM's
    ``FlatLogprobs`` (flat lists with per-position ranges) or a list of per-position dicts."""
    if hasattr(container, "start_indices"):  # FlatLogprobs: read its lists, build no dicts
        ids, values, starts, ends = container.token_ids, container.logprobs, container.start_indices, container.end_indices
        out = []
        for i, t in enumerate(tokens):
            j = next((j for j in range(starts[i], ends[i]) if ids[j] == t), None)
            if j is None:
                raise KeyError(f"vLLM returned no log-prob for the sampled token {t} at position {i}")
            out.append(float(values[j]))
        return out
    return [_sampled_logprob(container[i], t) for i, t in enumerate(tokens)]


@contextmanager
def _rng_preserved() -> Iterator[None]:
    """Restore the global random, numpy and torch (CPU and CUDA) RNG states on exit."""
    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    # This process's own GPU only: touching the others would create a CUDA context on each.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _barrier() -> None:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _process_rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


class VLLMGenerator(Generator):
    """Sample with a colocated vLLM engine; weights synced after each optimizer step.

    Each prompt group (consecutive identical prompts) becomes one request with ``n`` samples.
    Returns vLLM's log-probs of the sampled tokens as ``sampling_logps`` (used by the rollout
    correction). ``stats`` accumulates the seconds spent syncing weights, sleeping and waking.
    """

    Params = VLLMGeneratorParams
    accepts_generation_kwargs = True
    samples_from_policy = False

    def __init__(self, params: VLLMGeneratorParams | None = None) -> None:
        self.params = params or VLLMGeneratorParams()
        self.llm: Any = None
        self.calls = 0
        self.stats: dict[str, float] = {"syncs": 0, "sync_seconds": 0.0, "sleep_seconds": 0.0, "wake_seconds": 0.0}
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._sync_method = "load_weights"
        self._asleep = False
        self._pending_sync = False
        self._policy: Any = None
        # mode: server
        self.server: ServerClient | None = None
        self.served_model: str | None = None
        self._transport: WeightTransport | None = None

    # -- setup -------------------------------------------------------------------------------------

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        super().setup(model, tokenizer, sampling)
        if self.params.mode == "server":
            self._setup_server(model)
            return
        self._vllm = _import_vllm()
        from grpo_plugins.generators.common import unwrap_model

        self._policy = unwrap_model(model)
        with _rng_preserved():  # vLLM seeds random, numpy and torch globally when it starts
            self.llm = self._vllm.LLM(**self.engine_arguments(self._policy))
        self._sync_method = (
            self.params.weight_sync
            if self.params.weight_sync != "auto"
            else ("reload_weights" if _reload_takes_iterator() else "load_weights")
        )
        if self.params.sync_weights and self._tmpdir is None:
            # (An engine started from the checkpoint written just now already holds these weights.)
            self.on_weights_updated(model)

    def engine_arguments(self, policy: Any) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for this policy."""
        import torch

        source = self._weights_source(policy)
        dtype = next(policy.parameters()).dtype
        kwargs: dict[str, Any] = {
            "model": source,
            "tokenizer": source,
            "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32"),
            "gpu_memory_utilization": self.params.gpu_memory_utilization,
            "enable_prefix_caching": self.params.enable_prefix_caching,
            "enforce_eager": self.params.enforce_eager,
            "max_model_len": self.params.max_model_len,
        }
        if self.sampling.seed is not None:
            kwargs["seed"] = self.sampling.seed % 2**32  # it reaches np.random.seed
        if self.params.logprobs_mode is not None:
            kwargs["logprobs_mode"] = self.params.logprobs_mode
        if self.params.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # One engine per training process on its own GPU, sharing torch.distributed's setup.
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(self.params.engine_kwargs)
        return {k: v for k, v in kwargs.items() if v is not None}

    def _weights_source(self, policy: Any) -> str:
        """A folder vLLM can load the architecture and initial weights from: the policy's own
        checkpoint folder, else a clean checkpoint of it written to a temporary folder."""
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        path = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
        if path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
            return str(path)
        # A random initialisation, a GGUF or hub-cache model, or a LoRA over one of these:
        # base.save_pretrained would keep peft's base_layer / lora_A names, which vLLM rejects.
        self._tmpdir = tempfile.TemporaryDirectory(prefix="grpo-plugins-vllm-")
        write_engine_checkpoint(policy, self.tokenizer, self._tmpdir.name)
        return self._tmpdir.name

    # -- weight sync -------------------------------------------------------------------------------

    def memory_advice(self, phase: str) -> list[str]:
        if self.params.mode == "server":
            return []  # the server's memory is its own
        p = self.params
        advice = [
            f"generator.params.gpu_memory_utilization ({p.gpu_memory_utilization}; the colocated engine's share of "
            "the GPU, set under generator: {name: vllm, params: {...}})"
        ]
        if phase != "generation" and not p.enable_sleep_mode:
            advice.append(
                "generator.params.enable_sleep_mode (false; true frees the engine's KV cache and weights during "
                "training: generator: {name: vllm, params: {enable_sleep_mode: true}})"
            )
        return advice

    def on_weights_updated(self, model: Any) -> None:
        """Load the current policy weights into the engine, then drop its prefix cache; while
        the engine sleeps, at its next wake-up instead. In server mode: send them to the server."""
        if not self.params.sync_weights or (self.llm is None and self.server is None):
            return
        from grpo_plugins.generators.common import unwrap_model

        self._policy = unwrap_model(model)
        if self.server is not None:
            self._send_weights_to_server()
            return
        if self._asleep:
            self._pending_sync = True
            return
        self._load_weights()
        self.llm.reset_prefix_cache()

    def _load_weights(self) -> None:
        # A generator: merged LoRA weights exist one at a time, consumed in place by the single
        # in-process worker of this process's engine.
        weights = policy_weights(self._policy)
        start = time.perf_counter()
        if self._sync_method == "reload_weights":
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
        else:
            self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.stats["syncs"] += 1
        self.stats["sync_seconds"] += time.perf_counter() - start

    # -- sleep mode --------------------------------------------------------------------------------

    @property
    def sleep_level(self) -> int:
        """The level ``llm.sleep`` is called with (see ``VLLMGeneratorParams.sleep_level``)."""
        return self.params.sleep_level or (2 if self.params.sync_weights else 1)

    def _sleep(self) -> None:
        start = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)  # also clears the prefix cache
        self._asleep = True
        if self.sleep_level == 2:  # the weights are gone: the wake-up must load them
            self._pending_sync = True
        self.stats["sleep_seconds"] += time.perf_counter() - start

    def _wake(self) -> None:
        start = time.perf_counter()
        if self._pending_sync:
            # Weights first, loaded before the KV cache is allocated again, so the two never
            # hold GPU memory together with a stale copy.
            self.llm.wake_up(tags=["weights"])
            self._load_weights()
            self.llm.wake_up(tags=["kv_cache"])
            self._pending_sync = False
        else:
            self.llm.wake_up()
        self._asleep = False
        self.stats["wake_seconds"] += time.perf_counter() - start

    # -- server mode -----------------------------------------------------------------------------------

    def _setup_server(self, model: Any) -> None:
        """Wait for the server, check that it serves the policy's vocabulary, connect the weight
        transport (main process) and send the policy's weights once."""
        from grpo_plugins.generators.common import unwrap_model

        p = self.params
        self.server = ServerClient(p.server_host, p.server_port, p.server_timeout)
        self.server.wait_until_healthy(p.server_timeout)
        self.served_model = served_model(self.server, p.server_model)
        check_tokenizer(self.server, self.served_model, self.tokenizer)
        self._policy = unwrap_model(model)
        if p.sync_weights:
            if _process_rank() == 0:
                self._transport = TRANSPORTS[p.server_weight_transfer](p)
                self._transport.connect(self.server)
            # The server started from some checkpoint, not necessarily the policy's weights.
            self.on_weights_updated(model)

    def _send_weights_to_server(self) -> None:
        """The main process sends the policy's weights (tied copies once) and resets the
        server's prefix cache; every process then waits for it, so none generates with the old
        weights."""
        assert self.server is not None
        start = time.perf_counter()
        if self._transport is not None:
            base = self._policy.get_base_model() if hasattr(self._policy, "get_base_model") else self._policy
            tied = _tied_names(base)
            metadata = [m for m in policy_weight_metadata(self._policy) if m[0] not in tied]
            weights = ((n, t) for n, t in policy_weights(self._policy) if n not in tied)
            self._transport.send(self.server, weights, metadata)
            reset_prefix_cache(self.server)
        _barrier()
        self.stats["syncs"] += 1
        self.stats["sync_seconds"] += time.perf_counter() - start

    # -- generation ----------------------------------------------------------------------------------

    def sampling_fields(self, n: int, seed: int | None) -> dict[str, Any]:
        """The sampling fields of one request of ``n`` samples, named as vLLM's SamplingParams
        and its server's CompletionRequest both name them; vLLM gives sample j the seed
        ``seed + j``."""
        s = self.sampling
        return {
            "n": n,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k and s.top_k > 0 else 0,  # 0: off (vLLM's neutral value)
            "min_p": s.min_p or 0.0,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": s.max_completion_length,
            "logprobs": 0,  # the sampled token's own log-prob only
            "seed": seed,
            **s.extra,  # generation_kwargs (the sampling ones were moved to their keys)
        }

    def sampling_params(self, n: int, seed: int | None) -> Any:
        """vLLM SamplingParams for one request of ``n`` samples (:meth:`sampling_fields`)."""
        # The trainer reads token ids only; detokenizing costs host time per sampled token (and
        # per log-prob entry). Stop strings need the text, so they keep it on. (The server's
        # CompletionRequest has no such field: it always detokenizes.)
        engine_only = {"detokenize": "stop" in self.sampling.extra}
        if "flat_logprobs" in getattr(self._vllm.SamplingParams, "__struct_fields__", ()):
            # Log-probs as a few flat lists per completion instead of one dict per token (newer vLLMs).
            engine_only["flat_logprobs"] = True
        return self._vllm.SamplingParams(**{**engine_only, **self.sampling_fields(n, seed)})

    def seed_base(self, samples: int) -> int | None:
        """The first seed of this call's ``samples`` consecutive sample seeds: drawn from the
        config seed, the process rank and the call counter, so calls and processes get unrelated
        streams, and bounded so that the last seed still fits vLLM's int64 seed array."""
        if self.sampling.seed is None:
            return None
        rng = random.Random(f"{self.sampling.seed}/{_process_rank()}/{self.calls}")  # str: sha512, stable
        return rng.randrange(0, SEED_LIMIT - samples)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        if self.llm is None and self.server is None:
            raise RuntimeError("VLLMGenerator.generate called before setup")
        if self._asleep:
            self._wake()
        prompts, n = _group_repeats(prompt_ids)
        base = self.seed_base(len(prompts) * n)

        def seed(i: int) -> int | None:
            # Request i's samples get seeds base + i*n ... base + i*n + n-1: all distinct in a call.
            return None if base is None else base + i * n

        if self.server is not None:
            assert self.served_model is not None
            completions: list[Any] = generate_on_server(
                self.server, self.served_model, prompts, lambda i: self.sampling_fields(n, seed(i))
            )
            self.calls += 1
        else:
            params = [self.sampling_params(n, seed(i)) for i in range(len(prompts))]
            outputs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
            )
            self.calls += 1
            if self.params.enable_sleep_mode:
                self._sleep()
            completions = [c for request in outputs for c in request.outputs]
        if len(completions) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(completions)} completions for {len(prompt_ids)} prompts")
        return self.to_generation_output(completions)

    def to_generation_output(self, completions: list[Any]) -> GenerationOutput:
        """Convert vLLM CompletionOutputs (token_ids, logprobs, finish_reason) into tensors."""
        import torch

        from grpo_plugins.generators.common import eos_token_ids, unwrap_model

        eos = set(eos_token_ids(unwrap_model(self.model), self.tokenizer))
        pad = self.tokenizer.pad_token_id
        limit = self.sampling.max_completion_length
        rows: list[list[int]] = []
        logps: list[list[float]] = []
        truncated: list[bool] = []
        for c in completions:
            tokens = list(c.token_ids)[:limit]
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
            # vLLM also stops on stop strings/tokens (finish_reason "stop"); those are complete.
            truncated.append(cut is None and getattr(c, "finish_reason", "length") != "stop")
            tokens = tokens[:cut] if cut is not None else tokens
            rows.append(tokens)
            if c.logprobs is None:
                logps.append([0.0] * len(tokens))
            else:
                logps.append(sampled_logprobs(c.logprobs, tokens))
        width = max([len(r) for r in rows] + [1])
        ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
        sampling_logps = torch.zeros((len(rows), width), dtype=torch.float32)  # (B, T)
        for i, (row, lp) in enumerate(zip(rows, logps)):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
            sampling_logps[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        device = next(unwrap_model(self.model).parameters()).device
        has_logps = all(c.logprobs is not None for c in completions)
        return GenerationOutput(
            completion_ids=ids.to(device),
            completion_mask=mask.to(device),
            is_truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
            sampling_logps=sampling_logps.to(device) if has_logps else None,
        )

    # -- resuming and shutdown -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The call counter that seeds each generation (saved in checkpoints for resuming)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state.get("calls", 0))

    def close(self) -> None:
        """Shut the engine down (its GPU memory and vLLM's distributed state are released) and
        remove the temporary checkpoint; ``generate`` cannot be called afterwards. In server
        mode the weight transport is closed; the server keeps running."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.server = None
        if self.llm is not None:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
