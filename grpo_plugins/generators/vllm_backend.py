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

import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from grpo_plugins.generators.vllm_outputs import (
    group_repeats,
    sampled_logprobs,
)
from grpo_plugins.generators.vllm_params import SEED_LIMIT, VLLMGeneratorParams
from grpo_plugins.generators.vllm_runtime import (
    barrier,
    import_vllm,
    process_rank,
    reload_takes_iterator,
    rng_preserved,
)
from grpo_plugins.generators.vllm_server import (
    TRANSPORTS,
    ServerClient,
    WeightTransport,
    check_tokenizer,
    generate_on_server,
    reset_prefix_cache,
    served_model,
)
from grpo_plugins.generators.vllm_weights import (
    policy_weight_metadata,
    policy_weights,
    tied_names,
    write_engine_checkpoint,
)
from grpo_plugins.kinds import GenerationOutput, Generator, SamplingSettings

__all__ = [
    "SEED_LIMIT",
    "VLLMGenerator",
    "VLLMGeneratorParams",
    "group_repeats",
    "policy_weight_metadata",
    "policy_weights",
    "sampled_logprobs",
    "write_engine_checkpoint",
]


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
        self._vllm = import_vllm()
        from grpo_plugins.generators.common import unwrap_model

        self._policy = unwrap_model(model)
        with rng_preserved():  # vLLM seeds random, numpy and torch globally when it starts
            self.llm = self._vllm.LLM(**self.engine_arguments(self._policy))
        self._sync_method = (
            self.params.weight_sync
            if self.params.weight_sync != "auto"
            else ("reload_weights" if reload_takes_iterator() else "load_weights")
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
            if process_rank() == 0:
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
            tied = tied_names(base)
            metadata = [m for m in policy_weight_metadata(self._policy) if m[0] not in tied]
            weights = ((n, t) for n, t in policy_weights(self._policy) if n not in tied)
            self._transport.send(self.server, weights, metadata)
            reset_prefix_cache(self.server)
        barrier()
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
        rng = random.Random(f"{self.sampling.seed}/{process_rank()}/{self.calls}")  # str: sha512, stable
        return rng.randrange(0, SEED_LIMIT - samples)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        if self.llm is None and self.server is None:
            raise RuntimeError("VLLMGenerator.generate called before setup")
        if self._asleep:
            self._wake()
        prompts, n = group_repeats(prompt_ids)
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

    def generate_beside(self, prompt_ids: list[list[int]]) -> Callable[[], GenerationOutput] | None:
        """Server mode: the requests, sent from another thread while the training pass runs
        (``generate_ahead``); the server decodes on GPUs of its own, so generation and training
        overlap fully. The weights it samples from are sent after each optimizer step, which
        waits for this call. Colocated: None (the engine shares this GPU)."""
        if self.server is None:
            return None
        return lambda: self.generate(prompt_ids)

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
