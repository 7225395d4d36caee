"""Running next to vLLM: the environment it reads, importing it (or saying how to install it),
what the installed version supports, and the process's RNG, rank and barrier around it."""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from grpo_plugins.generators import GeneratorUnavailableError

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


def import_vllm() -> Any:
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


def reload_takes_iterator() -> bool:
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


@contextmanager
def rng_preserved() -> Iterator[None]:
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


def barrier() -> None:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def process_rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))
