"""Regional compilation of a model's decoder layers for the training and log-prob passes.

An eager forward+backward of a transformers decoder layer launches ~150 small kernels (RMSNorm,
rotary embedding, SiLU, casts), each costing tens of microseconds of host time. For a
0.5B-parameter model the host, not the GPU, then sets the pace of a training step, and every
extra forward+backward (row chunks, see ``row_chunks``) costs its full host time again.
Compiling each layer's ``forward`` (one compiled function shared by all layers of a class,
``dynamic=True`` so that rows and lengths do not recompile; see
``compile_cache.compile_region``) fuses the elementwise work and cuts the launches several-fold.
The compiled forward runs inside the model's own activation checkpointing, which recomputes it
in backward as usual. The chunked log-softmax over the
vocabulary (``logprobs.chunk_logps``) is compiled too, which also removes its (N, vocab) float32
temporaries (softmax, products) from the peak memory.

Compiled forwards are installed only inside :meth:`CompiledLayers.active` (the engine's training
and log-prob passes); generation and everything else see the model's eager layers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from grpo_plugins.compile_cache import compile_region, compile_settings
from grpo_plugins.logprobs import chunk_logps

__all__ = ["CompiledLayers", "compile_stats", "compiled_layers_for", "decoder_layers", "layers_active"]

logger = logging.getLogger(__name__)


def compile_stats() -> dict[str, float]:
    """What ``torch.compile`` has cost this process so far: ``compile/seconds`` (tracing and
    code generation, backward graphs included) and ``compile/graphs`` (graphs compiled; a count
    that grows after the first steps means recompilation)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = 0.0
    for key, times in compilation_time_metrics.items():
        if key == "_compile.compile_inner" or "bw_compiler" in key:
            seconds += float(sum(times))
    return {"compile/seconds": seconds, "compile/graphs": float(counters["stats"]["unique_graphs"])}


def decoder_layers(model: Any) -> list[torch.nn.Module] | None:
    """The decoder's layer modules of a transformers causal LM (peft-wrapped or not), or None
    where the model does not expose them as ``get_decoder().layers``."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    return list(layers)


class CompiledLayers:
    """``torch.compile``-d forwards of a model's decoder layers, switched on per block.

    Args:
        layers: the decoder layers.
        backend: the ``torch.compile`` backend ("inductor" on a GPU; "aot_eager" for tests).
    """

    def __init__(
        self,
        layers: list[torch.nn.Module],
        backend: str = "inductor",
        embeddings: torch.nn.Module | None = None,
        fused_logprobs: bool = False,
    ) -> None:
        self.layers = layers
        self.embeddings = embeddings
        compiled: dict[type, Any] = {}
        for layer in layers:
            cls = type(layer)
            if cls not in compiled:
                compiled[cls] = compile_region(cls.forward, backend=backend)
        self._forwards = [compiled[type(layer)].__get__(layer) for layer in layers]
        #: One chunk of the chunked log-softmax (pass as ``completion_logps(chunk_fn=...)``): the
        #: log-sum-exp, target gather and entropy fused, without (N, vocab) float32 temporaries;
        #: with ``fused_logprobs``, Triton kernels that read the logits once where they apply.
        self.chunk_logps: Any = compile_region(chunk_logps, backend=backend)
        if fused_logprobs:
            from grpo_plugins.fused_logprobs import FusedChunkLogps

            self.chunk_logps = FusedChunkLogps(self.chunk_logps)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Layers run their compiled forward inside the block (not re-entrant)."""
        for layer, forward in zip(self.layers, self._forwards):
            layer.forward = forward  # instance attribute: nn.Module.__call__ looks it up first
        # Every layer must see the same kind of input, or the compiled forward, which guards on
        # it, compiles a second graph (forward and backward) for the first layer. Frozen
        # embeddings (LoRA) give the first layer an input that does not require grad and every
        # later layer one that does: inside the block their output requires grad (as
        # transformers' enable_input_require_grads does). And transformers' own hook of that kind
        # (installed with gradient checkpointing) makes it require grad under no_grad too, where
        # no later layer's input does: there it is detached. Values and gradients are unchanged.
        hook = self.embeddings.register_forward_hook(_same_input_kind) if self.embeddings is not None else None
        try:
            with compile_settings():  # once for the block rather than once per layer call
                yield
        finally:
            if hook is not None:
                hook.remove()
            for layer in self.layers:
                layer.__dict__.pop("forward", None)

    @classmethod
    def for_model(cls, model: Any, backend: str = "inductor", fused_logprobs: bool = False) -> CompiledLayers | None:
        """Compiled layers of ``model``, or None (with a log line) where it has no layer list."""
        layers = decoder_layers(model)
        if layers is None:
            logger.info("compile_layers: the model exposes no decoder layer list; training stays eager")
            return None
        get_embeddings = getattr(model, "get_input_embeddings", None)
        embeddings = get_embeddings() if callable(get_embeddings) else None
        return cls(layers, backend=backend, embeddings=embeddings, fused_logprobs=fused_logprobs)


def compiled_layers_for(
    model: Any, compile_layers: bool | None, device: torch.device, *, quantized: bool = False
) -> CompiledLayers | None:
    """The decoder layers' compiled forwards for the training and log-prob passes, or None.

    Default (``compile_layers: null``): on for CUDA training, full fine-tuning and LoRA alike --
    on the H200 it cut the micro-step of a 0.5B model by 40 % and the GPU example's (LoRA)
    median step from 0.95 to 0.32 s (docs/performance.md) -- except over a quantized
    (bitsandbytes) base, whose layers have not been run compiled; off on a CPU. On CUDA with
    Triton the log-prob chunks then run :mod:`~grpo_plugins.fused_logprobs`'s kernels.
    """
    on_cuda = device.type == "cuda"
    if not (on_cuda and not quantized if compile_layers is None else compile_layers):
        return None
    if on_cuda:
        logger.info(
            "compile_layers: the decoder layers compile during the first training steps (up to about two "
            "minutes on a cold cache, once per machine and model shape); set compile_layers: false for short runs"
        )
    # Without a GPU there is nothing to gain from generated kernels; "aot_eager" traces the
    # same graphs without needing a C++ compiler (what the CPU tests exercise).
    if not on_cuda:
        return CompiledLayers.for_model(model, backend="aot_eager")
    from grpo_plugins.fused_logprobs import fused_logprobs_available

    return CompiledLayers.for_model(model, backend="inductor", fused_logprobs=fused_logprobs_available(device))


def _same_input_kind(module: torch.nn.Module, inputs: Any, output: Any) -> torch.Tensor | None:
    if not isinstance(output, torch.Tensor):
        return None
    if not torch.is_grad_enabled():
        return output.detach() if output.requires_grad else None
    if not output.requires_grad:
        output.requires_grad_(True)
    return None


@contextlib.contextmanager
def layers_active(compiled: CompiledLayers | None) -> Iterator[None]:
    """The compiled layers inside the block (when there are any); a compilation failure becomes
    one clear error instead of torch.compile's traceback."""
    if compiled is None:
        yield
        return
    from torch._dynamo.exc import TorchDynamoException

    from grpo_plugins.errors import TrainingError

    try:
        with compiled.active():
            yield
    except TorchDynamoException as exc:
        cause: BaseException = exc
        while True:  # down to the backend's own error (BackendCompilerFailed wraps it)
            inner = getattr(cause, "inner_exception", None) or cause.__cause__
            if not isinstance(inner, BaseException):
                break
            cause = inner
        text = str(cause).strip()
        reason = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        raise TrainingError(
            f"compile_layers: torch.compile failed on this model ({reason}); "
            "set compile_layers: false to train without compiling"
        ) from exc
