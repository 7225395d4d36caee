"""The ``vllm`` generation backend: a colocated vLLM engine, written against vLLM's documented
offline API (``LLM``, ``SamplingParams``, ``LLM.generate`` with token-id prompts,
``LLM.apply_model`` for weight loading).

Weight sync: after each optimizer step the policy's weights (LoRA deltas added in) are loaded
into the engine's model with ``llm.apply_model(lambda model: model.load_weights(weights))``
(vLLM >= 0.9; the engine is run in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so no weights
are pickled), falling back to the older
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` path; the prefix
cache is then reset, since cached prompt KV entries were computed with the old weights.

It samples from a copy of the policy in another engine, so ``samples_from_policy`` is False and
``vllm_importance_sampling_correction: auto`` turns truncated importance sampling on.

This backend has not run against a real vLLM here (vLLM cannot be installed on these machines);
tests exercise it against a fake of the API. torch and vllm are imported inside functions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.generators import GeneratorUnavailableError
from grpo_plugins.kinds import GenerationOutput, Generator, SamplingSettings

if TYPE_CHECKING:
    from torch import Tensor


class VLLMGeneratorParams(BaseModel):
    """Parameters of the ``vllm`` generator (engine construction and weight sync)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="GPU memory share of the colocated engine.")
    max_model_len: int | None = Field(None, ge=1, description="Context length; None: vLLM's default for the model.")
    enable_prefix_caching: bool = True
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (slower, less memory).")
    logprobs_mode: str | None = Field(
        "processed_logprobs",
        description="What the returned log-probs mean (vLLM >= 0.10.2): after temperature and penalties, "
        "as the trainer computes them. None: the engine's default.",
    )
    sync_weights: bool = Field(True, description="Load the policy's weights into the engine after each optimizer step.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for vllm.LLM.")


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: colocated
    try:
        import vllm
    except ImportError as exc:
        raise GeneratorUnavailableError(
            "the vllm generator (fast_inference: true) needs vLLM, which is not installed here: "
            "pip install 'grpo-plugins[vllm]' on a GPU machine, or set fast_inference: false / "
            "generator: transformers"
        ) from exc
    return vllm


def policy_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of ``model`` in transformers naming, produced lazily.

    For a peft model each LoRA-wrapped weight is yielded as ``base + delta`` computed out of
    place (the model is never merged and unmerged, which would drift low-precision base weights
    a little at every sync); adapter tensors are skipped and ``base_layer`` /
    ``modules_to_save`` names mapped back to the base model's.
    """
    import torch

    if not hasattr(model, "get_base_model"):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
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
        if layer is not None and not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}):
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        name = name.replace(".base_layer", "").replace(".modules_to_save.default", "")
        yield name, tensor.detach()


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


class VLLMGenerator(Generator):
    """Sample with a colocated vLLM engine; weights synced after each optimizer step.

    Each prompt group (consecutive identical prompts) becomes one request with ``n`` samples.
    Returns vLLM's log-probs of the sampled tokens as ``sampling_logps`` (used by the rollout
    correction). Not run on hardware here: see docs/models.md.
    """

    Params = VLLMGeneratorParams
    samples_from_policy = False

    def __init__(self, params: VLLMGeneratorParams | None = None) -> None:
        self.params = params or VLLMGeneratorParams()
        self.llm: Any = None
        self.calls = 0
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None

    # -- setup -------------------------------------------------------------------------------------

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        super().setup(model, tokenizer, sampling)
        self._vllm = _import_vllm()
        from grpo_plugins.generators.common import unwrap_model

        policy = unwrap_model(model)
        self.llm = self._vllm.LLM(**self.engine_arguments(policy))
        if self.params.sync_weights:
            self.on_weights_updated(policy)

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
            kwargs["seed"] = self.sampling.seed
        if self.params.logprobs_mode is not None:
            kwargs["logprobs_mode"] = self.params.logprobs_mode
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # One engine per training process on its own GPU, sharing torch.distributed's setup.
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(self.params.engine_kwargs)
        return {k: v for k, v in kwargs.items() if v is not None}

    def _weights_source(self, policy: Any) -> str:
        """A directory vLLM can load the architecture (and initial weights) from."""
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        path = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
        if path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
            return str(path)
        # A random initialisation or an in-memory model: write it once for the engine to read.
        self._tmpdir = tempfile.TemporaryDirectory(prefix="grpo-plugins-vllm-")
        base.save_pretrained(self._tmpdir.name)
        self.tokenizer.save_pretrained(self._tmpdir.name)
        return self._tmpdir.name

    # -- weight sync -------------------------------------------------------------------------------

    def on_weights_updated(self, model: Any) -> None:
        """Load the current policy weights into the engine, then drop its prefix cache."""
        if self.llm is None or not self.params.sync_weights:
            return
        from grpo_plugins.generators.common import unwrap_model

        # A generator: merged LoRA weights exist one at a time, consumed by the single
        # in-process worker of this process's engine.
        weights = policy_weights(unwrap_model(model))
        if getattr(self.llm, "apply_model", None) is not None:
            self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        else:  # vLLM < 0.9 (V0 engine)
            engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            engine_model.load_weights(weights)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    # -- generation ----------------------------------------------------------------------------------

    def sampling_params(self, n: int, request: int) -> Any:
        """vLLM SamplingParams for one request of ``n`` samples (``request`` varies the seed)."""
        s = self.sampling
        seed = None if s.seed is None else (s.seed * 1_000_003 + self.calls) * 65_537 + request
        return self._vllm.SamplingParams(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k else -1,
            min_p=s.min_p or 0.0,
            repetition_penalty=s.repetition_penalty,
            max_tokens=s.max_completion_length,
            logprobs=0,  # the sampled token's own log-prob only
            seed=seed,
        )

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        if self.llm is None:
            raise RuntimeError("VLLMGenerator.generate called before setup")
        prompts, n = _group_repeats(prompt_ids)
        params = [self.sampling_params(n, i) for i in range(len(prompts))]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
        )
        self.calls += 1
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
                logps.append([_sampled_logprob(c.logprobs[i], t) for i, t in enumerate(tokens)])
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
