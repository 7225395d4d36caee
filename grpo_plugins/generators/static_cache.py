"""The ``static`` generator: a fast generation backend for Llama-style models.

A static KV cache and a fixed-shape decode step that is compiled with ``torch.compile`` and
captured in a CUDA graph, with repetition penalty, temperature, top-k, top-p and min-p applied
inside the captured step; grouped-query attention reads the cache without repeating KV heads;
generation stops early once every row has finished (checked every ``check_every`` steps). Batch
and prompt length are padded to buckets, so a run compiles and captures once per bucket.

It samples with the trained model's own weights, read in place or, for LoRA models, from a
copy with the adapters merged that is refreshed before each generation (equal up to one rounding
to the model's dtype), so it needs no weight sync and no sampler/trainer correction -- unless
``fp8`` decodes from float8 copies, whose mismatch the rollout correction then corrects. Models it cannot run (other architectures, sliding
windows shorter than the sequence) fall back to the ``transformers`` generator with a warning,
or raise when ``fallback: false``. On the CPU it runs the same loop eagerly (the default there too). On a
bitsandbytes-quantised base the step is not compiled unless asked (see :func:`decode_flags`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.kinds import GenerationOutput, Generator, SamplingSettings

if TYPE_CHECKING:
    from grpo_plugins.generators.static_decode import StaticDecoder

logger = logging.getLogger(__name__)


def decode_flags(params: StaticCacheGenerator.Params, on_cuda: bool, quantized: bool) -> tuple[bool, bool]:
    """(compile, cuda_graph) for the decode step. Both need CUDA. A bitsandbytes-quantised base
    (``load_in_4bit``/``load_in_8bit``) is not compiled unless ``compile`` is set explicitly:
    its layers dequantise inside bitsandbytes' own kernels, which torch.compile does not fuse.
    The step is still captured in a CUDA graph (a capture that fails falls back to eager
    decoding, with a warning)."""
    compile_step = params.compile and on_cuda
    if on_cuda and quantized and "compile" not in params.model_fields_set:
        logger.info(
            "generator 'static': the base model is quantised (bitsandbytes), so the decode step runs "
            "its layers uncompiled%s (set the generator's compile param to true to compile it)",
            " in a CUDA graph" if params.cuda_graph else "",
        )
        compile_step = False
    return compile_step, params.cuda_graph and on_cuda


class StaticCacheGenerator(Generator):
    """Static-KV-cache generation with a compiled, CUDA-graph-captured decode step.

    Llama, Qwen2/Qwen3 and Mistral models, and prompts with images for Qwen2-VL / Qwen2.5-VL and
    Idefics3 / SmolVLM (the model's own forward reads the prompt and its images into the cache).
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        compile: bool = Field(True, description="torch.compile the decode step (CUDA only): one graph for a decoder layer and one for the head and sampling, compiled once for every batch and prompt bucket.")
        cuda_graph: bool = Field(True, description="Capture the decode step in a CUDA graph (CUDA only).")
        prompt_multiple: int = Field(64, ge=1, description="Left-pad prompts to a multiple of this many tokens.")
        check_every: int = Field(16, ge=1, description="Decode steps between checks for 'all rows finished'.")
        ignore_eos: bool = Field(False, description="Sample the full max_completion_length (benchmarks).")
        max_graphs: int = Field(2, ge=1, description="Decode graphs (and KV caches) kept at once.")
        release_cache: bool = Field(
            False,
            description="Free the KV cache and graph after each generation and hand their memory back to the driver (less memory while training; re-captures each time).",
        )
        max_batch_rows: int | None = Field(
            None,
            ge=1,
            description="Decode at most this many completions at a time; a larger batch is decoded in consecutive parts. The KV cache holds this many rows (16 x 8192 tokens at 7B: 7 GiB for 16, 3.5 for 8), and each part takes about as long as the whole batch would (decoding is bound by reading the weights). A power of two from 8 up wastes no padding rows on a GPU. Default: all at once.",
        )
        fallback: bool = Field(True, description="Use the transformers generator for unsupported models.")
        merge_weights: bool | None = Field(
            None,
            description="Decode from copies of the projection weights with the LoRA deltas merged in and q/k/v and gate/up fused, refreshed before each generation (one extra copy of those weights; much faster LoRA decoding). Default: on for LoRA models whose layers allow it (not for quantised bases), and for full fine-tuning on a GPU when the copy takes at most 5% of its memory (about 10% faster decoding at 0.5B-1.5B); false reads the model's own modules.",
        )

        fp8: bool = Field(
            False,
            description="Decode from float8 (e4m3) copies of the merged projection weights, one scale per output channel, with the activations quantised to float8 per row (GPUs with float8 tensor cores: Ada, Hopper and newer; decode batches of up to 128 rows through a Triton kernel made for few rows, the prefill through torch._scaled_mm): half the weight bytes a decode step reads (7B LoRA on an H200: generation 4.4 instead of 5.7 s for 64 x 1024 tokens). The sampler is then no longer exactly the trained policy, so vllm_importance_sampling_correction: auto turns the rollout correction on. The LM head and attention stay 16-bit.",
        )

        fused_attention: bool | None = Field(
            None,
            description="Compute the decode step's attention, with the new token's RoPE and cache writes, as one Triton kernel that reads the window's keys and values once, instead of torch operations (two batched products and a softmax; 7B LoRA on an H200: 5.7 instead of 6.7 ms per generated token). Default: on where it can run (a CUDA device with Triton, a bfloat16 or float16 model, head dimension a power of two from 16 to 256) and where it agrees with the torch operations in a check once per device; false keeps the torch operations.",
        )

        persistent_layers: bool | None = Field(
            False,
            description="Decode each layer as one persistent Triton kernel: a program per multiprocessor runs the norms, products, attention and MLP one after another with grid-wide barriers between them, instead of ~10 kernels per layer (Qwen2.5-0.5B at 64 rows on an H100: 1.324 instead of 1.397 ms per token; slower at 1.5B and on SmolLM2-135M at 128 rows). Needs the merged 16-bit weight copies (merge_weights, not fp8), Llama/Qwen2-style layers without query/key norms, an Ampere or newer GPU to itself (not shared through MPS), at most 128 rows a step (64 where a layer needs taller weight tiles, as 1.5B does); checked once per device against the torch layer. None: where it can run; true where it cannot is an error.",
        )

        parallel_parts: int = Field(
            1,
            ge=1,
            description="Decode the batch as this many parts at once: each part has its own KV cache, and a decode step is one CUDA graph holding the parts as parallel branches (one part's kernels run in the gaps of another's; each part reads the weights once per step). Meant for small models whose decode step is mostly fixed per-kernel costs. Not with persistent_layers. Experimental: the first GPU run of an earlier form (a graph per part, replayed on streams of their own) hung at the first generation; this form has run only on a CPU (bench/check_parallel_parts.py checks it on a GPU). 1: the batch as one.",
        )

    samples_from_policy = True
    # Prompts with images: the vision-language model's own forward fills the cache, then the
    # static loop decodes with its language model (Qwen2-VL / Qwen2.5-VL, Idefics3 / SmolVLM).
    accepts_images = True

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        # Sampling from float8 weights is sampling from a neighbour of the policy.
        self.samples_from_policy = not self.params.fp8
        self.calls = 0
        self._decoder: StaticDecoder | None = None
        self._fallback: Generator | None = None
        self._other_decoders: dict[str, StaticDecoder] = {}  # by sampling settings

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        from grpo_plugins.fp8_base import has_float8_base
        from grpo_plugins.generators.static_decode import UnsupportedModelError
        from grpo_plugins.models import prepare_tokenizer

        super().setup(model, tokenizer, sampling)
        if tokenizer.pad_token_id is None:
            prepare_tokenizer(tokenizer)
        self._decoder, self._fallback, self._other_decoders = None, None, {}
        try:
            self._decoder = self._make_decoder(sampling)
        except UnsupportedModelError as exc:
            if not self.params.fallback:
                raise
            self._use_fallback(str(exc))
        # Merged copies of a float8 base (load_in_fp8) do not quantise their inputs as its layers do.
        merged_float8 = self._decoder is not None and self._decoder.merge_weights and has_float8_base(model)
        self.samples_from_policy = not self.params.fp8 and not merged_float8

    def _make_decoder(self, sampling: SamplingSettings) -> StaticDecoder:
        import torch

        from grpo_plugins.generators.common import eos_token_ids, unwrap_model
        from grpo_plugins.generators.static_decode import StaticDecoder
        from grpo_plugins.quantization import is_quantized

        inner = unwrap_model(self.model)
        on_cuda = next(inner.parameters()).device.type == "cuda" and torch.cuda.is_available()
        compile_step, cuda_graph = decode_flags(self.params, on_cuda, is_quantized(inner))
        return StaticDecoder(
            inner,
            sampling,
            eos_token_ids(inner, self.tokenizer),
            int(self.tokenizer.pad_token_id),
            compile=compile_step,
            cuda_graph=cuda_graph,
            prompt_multiple=self.params.prompt_multiple,
            check_every=self.params.check_every,
            stop_at_eos=not self.params.ignore_eos,
            max_graphs=self.params.max_graphs,
            release_cache=self.params.release_cache,
            merge_weights=self.params.merge_weights,
            max_batch_rows=self.params.max_batch_rows,
            fp8=self.params.fp8,
            fused_attention=self.params.fused_attention,
            persistent_layers=self.params.persistent_layers,
            parallel_parts=self.params.parallel_parts,
        )

    @contextlib.contextmanager
    def sampling_override(self, sampling: SamplingSettings) -> Iterator[None]:
        """Decode with ``sampling`` inside the block. The settings are compiled into the decode
        step, so this uses a second decoder (its own KV caches and graphs; the merged LoRA
        weights are shared), built on first use and kept for the next evaluation."""
        if self._decoder is None:  # on the fallback
            assert self._fallback is not None
            with self._fallback.sampling_override(sampling):
                yield
            return
        key = repr(sampling)  # the settings as a hashable key (``extra`` is a dict)
        if key not in self._other_decoders:
            other = self._make_decoder(sampling)
            if self._decoder.merge_weights and other.merge_weights:
                # One set of merged LoRA weights for both decoders (each refreshes it before
                # decoding), not a second copy of every projection weight.
                self._decoder._decode_parts()
                other._merged = self._decoder._merged
            self._other_decoders[key] = other
        previous = self._decoder, self.sampling
        self._decoder, self.sampling = self._other_decoders[key], sampling
        try:
            yield
        finally:
            self._decoder, self.sampling = previous

    def _use_fallback(self, reason: str) -> None:
        from grpo_plugins.registry import get_registry

        logger.warning("%s; falling back to generator 'transformers'", reason)
        self._decoder = None
        registry = self.registry if self.registry is not None else get_registry()  # the run's, set by the engine
        self._fallback = registry.build("generator", "transformers")
        self._fallback.registry = registry
        self._fallback.setup(self.model, self.tokenizer, self.sampling)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        from grpo_plugins.generators.static_decode import UnsupportedModelError

        if self._decoder is not None:
            try:
                ids, mask, truncated, logps = self._generate_seeded(prompt_ids)
                return GenerationOutput(ids, mask, truncated, logps)
            except UnsupportedModelError as exc:  # e.g. a sequence longer than a sliding window
                if not self.params.fallback:
                    raise
                self._use_fallback(str(exc))
        if self._fallback is None:
            raise RuntimeError("generator 'static': generate() called before setup()")
        return self._fallback.generate(prompt_ids)

    def generate_beside(self, prompt_ids: list[list[int]]) -> Callable[[], GenerationOutput] | None:
        """Capture here what the decode needs and take this call's seed; the returned call only
        replays (from the merged copies; None without them, or on the fallback)."""
        from grpo_plugins.generators.common import seeded_call
        from grpo_plugins.generators.static_decode import UnsupportedModelError

        decoder = self._decoder
        try:
            if decoder is None or not decoder.prepare(prompt_ids):
                return None
        except UnsupportedModelError:  # generate() says so, or falls back
            return None
        call, self.calls = self.calls, self.calls + 1

        def run() -> GenerationOutput:
            with seeded_call(self.sampling.seed, call, decoder.parts.embed.weight.device):
                return GenerationOutput(*decoder.generate(prompt_ids))

        return run

    def _generate_seeded(self, prompt_ids: list[list[int]]) -> Any:
        """Decode under the seed ``sampling.seed`` plus a per-call counter (as the transformers
        generator does), leaving the global RNG state as it was."""
        from grpo_plugins.generators.common import seeded_call

        assert self._decoder is not None
        call, self.calls = self.calls, self.calls + 1
        with seeded_call(self.sampling.seed, call, self._decoder.parts.embed.weight.device):
            return self._decoder.generate(prompt_ids)

    def state_dict(self) -> dict[str, int]:
        """The call counter that seeds each generation (saved in checkpoints for resuming)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state.get("calls", 0))

    def memory_advice(self, phase: str) -> list[str]:
        if self._decoder is None:
            return self._fallback.memory_advice(phase) if self._fallback is not None else []
        advice = []
        if self._decoder.merge_weights:
            advice.append(
                "generator.params.merge_weights (on: decoding keeps a merged, fused copy of the projection "
                "weights; false drops it, decoding slower (about 2x for LoRA, 10% for full fine-tuning): "
                "generator: {name: static, params: {merge_weights: false}})"
            )
        if phase == "generation" and self.params.max_batch_rows is None:
            advice.append(
                "generator.params.max_batch_rows (unset: every completion of a generation decodes at once, "
                "and the KV cache holds them all; e.g. 8 decodes 8 at a time: generator: {name: static, "
                "params: {max_batch_rows: 8}})"
            )
        if phase != "generation" and not self.params.release_cache:
            advice.append(
                "generator.params.release_cache (false; true frees the KV cache and decode graphs before "
                "the log-prob and training passes: generator: {name: static, params: {release_cache: true}})"
            )
        return advice

    def on_weights_updated(self, model: Any) -> None:
        # The captured graph reads the parameters in place, so in-place optimizer updates need
        # nothing; a model whose parameters were re-allocated is detected in generate().
        if self._fallback is not None:
            self._fallback.on_weights_updated(model)
