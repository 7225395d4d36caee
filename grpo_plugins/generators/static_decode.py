"""The decode loop behind the ``static`` generator: a static KV cache, a fixed-shape decode step
(compiled and captured in a CUDA graph on GPUs) with sampling inside it.

The loop drives the Hugging Face model's own submodules (embedding, per-layer norms, q/k/v/o
projections, MLP, rotary embedding, final norm, LM head) rather than copies of their weights, so
a peft LoRA adapter is applied exactly as in training and optimizer updates (made in place) are
seen by the captured graph at once. Supported: Llama-style decoders (``llama``, ``qwen2``,
``qwen3``, ``mistral``); :func:`check_supported` says why another model is not.

Layout. Prompts are left-padded to ``P`` (a bucket), the batch to ``B`` rows (a bucket); the cache
holds ``S = P + T`` positions per layer, ``T`` = max completion length. Every decode step has the
same shapes: it writes the new key/value at cache index ``cur`` and attends over a window of the
first ``W`` positions under a validity mask. One graph is captured per window (W = P + a multiple
of :func:`attention_windows`' step, sharing one cache and memory pool), and each step replays the
smallest window that holds ``cur``: a step reads only about the part of the cache written so far.

This module runs the loop (:class:`StaticDecoder`); the model's parts and merged weights are in
:mod:`~grpo_plugins.generators.static_layers`, the prefill and decode step in
:mod:`~grpo_plugins.generators.static_steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from grpo_plugins.compile_cache import compile_region, compile_settings
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.fp8_base import float8_unsupported
from grpo_plugins.generators.common import cut_at_eos
from grpo_plugins.generators.decode_attention import use_fused_attention
from grpo_plugins.generators.static_layers import (
    SUPPORTED_MODEL_TYPES,
    DecoderParts,
    MergedLayer,
    UnsupportedModelError,
    check_supported,
    fused_copy_is_small,
    has_lora,
    merged_layers_supported,
)
from grpo_plugins.generators.persistent_layer import (
    check_barriers,
    persistent_decode_head,
    persistent_decode_layer,
    use_persistent_layers,
)
from grpo_plugins.generators.static_parts import WindowGraphs, capture_windows, decode_windows, in_turn, join_parts
from grpo_plugins.generators.static_steps import (
    DecodeState,
    attention_windows,
    batch_bucket,
    bucket,
    decode_head,
    decode_layer,
    decode_step,
    prefill_distinct,
    prefill_with_images,
    process_logits,
    sample_tokens,
)
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.multimodal import collate, multimodal_of

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecodeState",
    "MergedLayer",
    "StaticDecoder",
    "UnsupportedModelError",
    "attention_windows",
    "batch_bucket",
    "bucket",
    "check_supported",
    "decode_head",
    "decode_layer",
    "decode_step",
    "join_parts",
    "process_logits",
    "return_freed_memory",
    "sample_tokens",
]

logger = logging.getLogger(__name__)


def _with_compile_settings(step: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    with compile_settings():  # once per decode step rather than once per layer
        step(*args, **kwargs)


def return_freed_memory(device: torch.device) -> None:
    """Hand the allocator's unused blocks back to the driver (CUDA only).

    After ``release_cache`` frees the KV cache and graph pool, their blocks would otherwise stay
    reserved by torch's caching allocator, and the training pass, whose tensors have other sizes,
    reserves new blocks on top of them: at 7B x 16 x 8192 the training pass reserved 25.7 GiB for
    18.9 GiB allocated. Generation has synchronised already, so this costs little.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()


class StaticDecoder:
    """Generates with a static KV cache; keeps one decode graph per (batch, prompt) bucket.

    Args:
        model: the (possibly peft/DDP-wrapped) causal LM being trained.
        sampling: the run's sampling settings.
        eos_ids: token ids that end a completion.
        pad_id: the id written after EOS.
        compile: ``torch.compile`` the decode step (CUDA only).
        cuda_graph: capture the decode step in a CUDA graph (CUDA only).
        prompt_multiple: prompts are left-padded to a multiple of this many tokens.
        check_every: decode steps between checks whether every row has finished (one host sync).
        stop_at_eos: False keeps sampling past EOS (benchmarks that want full-length completions).
        max_graphs: graphs (with their KV caches) kept at once, least recently used dropped first.
        release_cache: drop every graph and KV cache (and merged weights) at the end of each
            ``generate``.
        max_batch_rows: decode at most this many rows at a time (None: all at once); a longer
            batch is decoded in consecutive parts, so the KV cache holds this many rows.
        parallel_parts: decode the batch as this many parts at once, each with its own KV cache,
            as parallel branches of one CUDA graph per step
            (:mod:`~grpo_plugins.generators.static_parts`); 1: the batch as one.
        window_step: cache slots added from one attention window to the next (one captured
            graph per window, at most 16 per bucket).
        fp8: decode from float8 (e4m3) merged copies of the projection weights (implies
            ``merge_weights``; :class:`~grpo_plugins.generators.static_layers.FusedLinear`).
        compile_backend: the ``torch.compile`` backend (``aot_eager`` in CPU tests).
        merge_weights: decode from :class:`MergedLayer` copies of the projection weights (LoRA
            deltas merged, q/k/v and gate/up fused), refreshed before each ``generate``; costs one
            copy of those weights. None (auto): on for a LoRA model whose layers allow it, where
            the adapters' separate small products (float32 under peft) otherwise dominate a
            decode step, and for full fine-tuning on a GPU when the copy is at most
            :data:`~grpo_plugins.generators.static_layers.FUSED_COPY_SHARE` of its memory
            (fused products: ~10% faster decoding at 0.5B-1.5B).
        fused_attention: the decode attention as one Triton kernel
            (:mod:`~grpo_plugins.generators.decode_attention`); None (auto): where it can run.
        persistent_layers: decode each layer as one persistent Triton kernel
            (:mod:`~grpo_plugins.generators.persistent_layer`); None (auto): where it can run.
    """

    def __init__(
        self,
        model: Any,
        sampling: SamplingSettings,
        eos_ids: list[int],
        pad_id: int,
        *,
        compile: bool = True,
        cuda_graph: bool = True,
        prompt_multiple: int = 64,
        check_every: int = 16,
        stop_at_eos: bool = True,
        max_graphs: int = 2,
        release_cache: bool = False,
        compile_backend: str = "inductor",
        merge_weights: bool | None = None,
        max_batch_rows: int | None = None,
        window_step: int = 128,
        fp8: bool = False,
        fused_attention: bool | None = None,
        persistent_layers: bool | None = False,
        parallel_parts: int = 1,
    ) -> None:
        if parallel_parts < 1:
            raise GRPOPluginsError(f"generator 'static': parallel_parts must be at least 1, got {parallel_parts}")
        if parallel_parts > 1 and persistent_layers:
            raise GRPOPluginsError(
                "generator 'static': persistent_layers needs the whole GPU for one part's step, and parallel_parts "
                "decodes parts at once; set one of them back (parallel_parts: 1 or persistent_layers: false)"
            )
        self.model = model
        self.parallel_parts = parallel_parts
        self.window_step = window_step
        self.max_batch_rows = max_batch_rows
        self.parts = check_supported(model)
        self.sampling = sampling
        self.eos_ids = sorted(set(eos_ids))
        self.pad_id = pad_id
        self.compile = compile
        self.cuda_graph = cuda_graph
        self.prompt_multiple = prompt_multiple
        self.check_every = max(1, check_every)
        self.stop_at_eos = stop_at_eos and bool(self.eos_ids)
        self.max_graphs = max_graphs
        self.release_cache = release_cache
        self.compile_backend = compile_backend
        self._graphs: dict[tuple[int, ...], WindowGraphs] = {}
        self._weights_key: tuple[int, ...] = ()
        self._compiled_step: Callable[..., None] | None = None
        self._persistent_step: Callable[..., None] | None = None
        self.persistent_layers = persistent_layers if parallel_parts == 1 else False
        self._merged: list[MergedLayer] | None = None
        reason = merged_layers_supported(self.parts)
        if fp8:
            if merge_weights is False:
                raise GRPOPluginsError("generator 'static': fp8 decodes from merged weight copies; drop merge_weights: false")
            merge_weights = True
            unsupported = float8_unsupported(self.parts.embed.weight.device)
            if unsupported is not None:
                raise GRPOPluginsError(f"generator 'static': fp8 cannot run here: {unsupported}; set fp8: false")
        if merge_weights is None:
            merge_weights = reason is None and (has_lora(self.parts) or fused_copy_is_small(self.parts))
        elif merge_weights and reason is not None:
            what = "fp8" if fp8 else "merge_weights"
            raise UnsupportedModelError(f"generator 'static': {what} needs mergeable layers, but {reason}")
        self.merge_weights = merge_weights
        self.fp8 = fp8
        self.parts = dataclasses.replace(self.parts, fused_attention=use_fused_attention(self.parts, fused_attention))

    # -- graphs ---------------------------------------------------------------------------------

    def _param_key(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _step_fn(self) -> Callable[..., None]:
        if self._compiled_step is None:
            fn: Callable[..., None] = decode_step
            if self.compile:
                # Regional compilation: one graph for a layer (shared by every layer) and one for
                # the head and sampling, with batch rows and cache length symbolic (head counts and
                # sampling settings constants: compile_region). Compiling the
                # whole unrolled step instead took minutes on a 30-layer LoRA model and
                # recompiled for every new (batch, prompt) bucket; now a bucket costs only a
                # CUDA-graph capture.
                layer_fn = compile_region(decode_layer, fullgraph=True, backend=self.compile_backend)
                head_fn = compile_region(decode_head, fullgraph=True, backend=self.compile_backend)
                step = functools.partial(decode_step, layer_fn=layer_fn, head_fn=head_fn)
                fn = functools.partial(_with_compile_settings, step)
            self._compiled_step = fn
        return self._compiled_step

    def _persistent_step_fn(self) -> Callable[..., None]:
        """The decode step with :func:`persistent_decode_layer` layers (Triton, not compiled)."""
        if self._persistent_step is None:
            head = compile_region(persistent_decode_head, fullgraph=True, backend=self.compile_backend) if self.compile else persistent_decode_head
            self._persistent_step = functools.partial(decode_step, layer_fn=persistent_decode_layer, head_fn=head)
        return self._persistent_step

    def _graph(
        self, parts: DecoderParts, B: int, P: int, T: int, device: torch.device, dtype: torch.dtype, count: int = 1
    ) -> WindowGraphs:
        """The graphs (and caches) of ``count`` parts of ``B`` rows decoded at once."""
        key = (B, P, T, count)
        if key in self._graphs:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            return self._graphs[key]
        while len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        states = []
        for _ in range(count):
            st = DecodeState.allocate(
                parts, B, P + T, T, len(self.eos_ids), self.sampling.repetition_penalty != 1.0, dtype, device
            )
            st.eos.copy_(torch.tensor(self.eos_ids, dtype=torch.long))
            states.append(st)
        step = self._persistent_step_fn() if use_persistent_layers(parts, B, self.persistent_layers) else self._step_fn()
        windows = attention_windows(P, T, self.window_step)
        steps = [
            [functools.partial(step, parts, st, self.sampling, self.pad_id, self.stop_at_eos, window=w) for st in states]
            for w in windows
        ]
        entry = WindowGraphs(states, windows, [in_turn(window_steps) for window_steps in steps])
        if device.type == "cuda" and self.cuda_graph:
            try:
                entry = WindowGraphs(states, windows, capture_windows(states, steps, device))
            except RuntimeError as exc:  # e.g. a quantised layer's kernel that cannot be captured
                logger.warning(
                    "generator 'static': capturing the decode step in a CUDA graph failed (%s); decoding "
                    "without a graph from now on", str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                self.cuda_graph = False
        self._graphs[key] = entry
        return entry

    def clear(self) -> None:
        """Drop every graph and cache (e.g. after the model's parameters were replaced)."""
        self._graphs.clear()

    def _decode_parts(self) -> DecoderParts:
        """The parts the decode loop reads: the model's own, or merged copies brought up to date
        with the current weights."""
        if not self.merge_weights:
            return self.parts
        if self._merged is None:
            self._merged = [MergedLayer(layer, self.fp8) for layer in self.parts.layers]
            extra = sum(b.numel() * b.element_size() for m in self._merged for b in m.buffers())
            logger.info(
                "generator 'static': decoding from merged, fused copies of the projection weights (%.2f GiB)",
                extra / 2**30,
            )
        else:
            for layer in self._merged:
                layer.refresh()
        return dataclasses.replace(self.parts, layers=self._merged)

    # -- generation -----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample completions for ``prompt_ids``.

        Returns ``(completion_ids, completion_mask, is_truncated, sampling_logps)`` with
        shapes (B, T'), (B, T'), (B,), (B, T'), T' = the longest completion (EOS included).
        """
        rows, longest, groups = self._layout(prompt_ids)
        out = join_parts([part for group in groups for part in self._sample(group, longest, rows)], self.pad_id)
        if self.release_cache:
            # Only here, once _sample has returned: its locals hold the graph, the KV cache and the
            # merged layers until then, and the allocator cannot hand back blocks still in use.
            self.clear()
            self._merged = None
            return_freed_memory(self.parts.embed.weight.device)
        return out

    def _layout(self, prompt_ids: list[list[int]]) -> tuple[int, int, list[list[list[list[int]]]]]:
        """(rows per part, longest prompt, the groups of parts decoded at once)."""
        if any(len(p) == 0 for p in prompt_ids):
            raise GRPOPluginsError("generator 'static': every prompt needs at least one token")
        n = len(prompt_ids)
        rows = min(self.max_batch_rows or n, n, -(-n // self.parallel_parts))
        # Every part is decoded in graphs and caches shaped for the longest prompt of the batch
        # and the largest part, so a shorter part does not capture (and keep) others.
        longest = max(len(p) for p in prompt_ids)
        chunks = [prompt_ids[i : i + rows] for i in range(0, n, rows)]
        return rows, longest, [chunks[i : i + self.parallel_parts] for i in range(0, len(chunks), self.parallel_parts)]

    @torch.no_grad()
    def prepare(self, prompt_ids: list[list[int]]) -> bool:
        """Compile and capture what ``generate(prompt_ids)`` decodes with, so that it then only
        replays (``generate_ahead`` runs it in a thread beside the training pass). False where
        that generation would still run the model's own modules (no merged copies, or images),
        which must not change mode beside a training pass."""
        rows, longest, groups = self._layout(prompt_ids)
        if not self.merge_weights or any(multimodal_of(p) for p in prompt_ids):
            return False
        for count in sorted({len(group) for group in groups}):
            self._sample_graphs(count, longest, rows)
        return True

    def _sample_graphs(self, count: int, longest: int, rows: int) -> tuple[DecoderParts, WindowGraphs, int]:
        """The parts (merged copies refreshed), the graphs and caches for ``count`` parts of at
        most ``rows`` prompts no longer than ``longest``, and the prompt width P."""
        key = self._param_key()
        if key != self._weights_key:  # parameters re-allocated: captured addresses are stale
            self.clear()
            self._weights_key = key
        device = self.parts.embed.weight.device
        dtype = self.parts.embed.weight.dtype
        T = self.sampling.max_completion_length
        P = bucket(longest, self.prompt_multiple)
        B = batch_bucket(rows) if device.type == "cuda" else rows
        window = self.parts.sliding_window
        if window is not None and P + T > window:
            raise UnsupportedModelError(
                f"generator 'static': prompt + completion ({P + T} tokens) exceed the model's "
                f"sliding window ({window}); use generator: transformers"
            )
        parts = self._decode_parts()
        return parts, self._graph(parts, B, P, T, device, dtype, count), P

    def _sample(self, group: list[list[list[int]]], longest: int, rows: int) -> list[tuple[torch.Tensor, ...]]:
        """Decode the parts of ``group`` at once (each at most ``rows`` prompts, none longer than
        ``longest`` tokens) in the graphs and caches for (rows, longest, parts)."""
        device = self.parts.embed.weight.device
        T = self.sampling.max_completion_length
        # Merged copies hold no dropout and text prompts run none of the model's modules: leave the
        # model's mode alone (a training pass beside this generation reads it).
        own_modules = not self.merge_weights or any(multimodal_of(p) for part in group for p in part)
        was_training = self.model.training
        if own_modules:
            self.model.eval()  # no dropout (LoRA) while sampling
        try:
            parts, graphs, P = self._sample_graphs(len(group), longest, rows)
            counts = [self._begin(parts, st, prompts, P) for st, prompts in zip(graphs.states, group)]
            steps = decode_windows(graphs, P, T, self.check_every, self.stop_at_eos)
        finally:
            if own_modules:
                self.model.train(was_training)
        if device.type == "cuda":
            check_barriers(device)
        return [self._end(st, n, steps) for st, n in zip(graphs.states, counts)]

    def _begin(self, parts: DecoderParts, st: DecodeState, prompt_ids: list[list[int]], P: int) -> int:
        """Prefill ``prompt_ids`` (left-padded to ``P``) into ``st`` and sample their first
        tokens: ready for the decode steps. Returns the prompt count."""
        device = self.parts.embed.weight.device
        dtype = self.parts.embed.weight.dtype
        n, B = len(prompt_ids), st.done.shape[0]
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros(B, P, dtype=torch.bool)
        for row, p in enumerate(prompt_ids):
            ids[row, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[row, P - len(p) :] = True
        valid[n:, P - 1] = True  # padding rows attend to one slot, so nothing is fully masked
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, P), as generate() does

        images = collate([multimodal_of(p) for p in prompt_ids], ids, P, dtype)  # {} for text prompts
        if images:
            logits, start = prefill_with_images(self.model, parts, ids, valid, positions, images, st.k_cache, st.v_cache)
        else:
            logits = prefill_distinct(parts, ids, valid, positions, st.k_cache, st.v_cache)  # (B, V)
            start = valid.long().sum(-1)
        st.key_valid[:, :P] = valid
        st.key_valid[:, P:] = True
        st.done.zero_()
        st.done[n:] = True
        if st.seen is not None:
            st.seen.zero_()
            st.seen.scatter_(1, ids, valid)
        token, logp = sample_tokens(logits, st.seen, self.sampling)
        token = torch.where(st.done, self.pad_id, token)
        st.out_tokens.fill_(self.pad_id)
        st.out_logps.zero_()
        st.out_tokens[:, 0] = token
        st.out_logps[:, 0] = torch.where(st.done, 0.0, logp)
        if self.stop_at_eos:
            st.done |= (token[:, None] == st.eos).any(dim=-1)
        if st.seen is not None:
            st.seen.scatter_(1, token[:, None], True)
        st.token.copy_(token)
        st.position.copy_(start)
        st.cur.fill_(P)
        st.step.fill_(1)
        return n

    def _end(self, st: DecodeState, n: int, steps: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` rows' completions after ``steps`` tokens, cut at EOS."""
        tokens = st.out_tokens[:n, :steps].clone()  # (n, steps)
        logps = st.out_logps[:n, :steps].clone()
        if self.stop_at_eos:
            is_eos = (tokens[:, :, None] == st.eos).any(dim=-1)  # (n, steps)
        else:
            is_eos = torch.zeros_like(tokens, dtype=torch.bool)
        tokens, mask, truncated, _ = cut_at_eos(tokens, is_eos, self.pad_id)  # (n, T) (n, T) (n,)
        logps = logps[:, : mask.shape[1]].masked_fill(mask == 0, 0.0)
        return tokens, mask, truncated, logps
