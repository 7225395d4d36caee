"""FSDP (``fsdp:``): full fine-tuning with parameters, gradients and optimizer state sharded
over the processes, using torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

* :func:`shard_model` shards each decoder layer and then the rest of the model (embeddings,
  final norm, LM head) over a 1-D device mesh of all processes. With 16-bit weights (``dtype:
  bfloat16``) the shards are kept in float32 and each forward gathers them in 16 bits
  (``MixedPrecisionPolicy``): the float32 shards are the master weights.
* :func:`gathered` holds every sharded module's full weights for a block (one all-gather per
  module on entry, on every process in the same order): generation, the old/reference
  log-prob passes and evaluation run inside it, so each process decodes on its own with full
  weights and no collective per decode step (processes may make different numbers of forward
  calls there). Outside it each forward and backward gathers and frees one layer at a time.
* :func:`save_sharded` / :func:`load_sharded` write and read model, optimizer (and a moving
  reference model) with ``torch.distributed.checkpoint``: each process writes its own shards,
  and a checkpoint loads into any number of processes (it is resharded on load).

Why torch's ``fully_shard`` and not accelerate's ``FullyShardedDataParallelPlugin``: accelerate
1.15 only turns FSDP on for GPU-type launches (on CPUs it silently falls back to DDP), so its
path could not be tested here. ``fully_shard`` is what accelerate's FSDP2 calls underneath; the
same code runs on CPUs (gloo, CI) and GPUs (NCCL). accelerate still sets up the processes,
devices, gathers and reductions.

A run with ``fsdp`` on one process shards over a mesh of one (a single-process group is made
for it), so its numerics, checkpoints and code path are the same as on several processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from grpo_plugins.config import FSDPSettings


#: Subdirectory of a checkpoint holding the ``torch.distributed.checkpoint`` files.
SHARDED_DIR = "sharded"


def ensure_process_group(device: torch.device) -> bool:
    """Start a single-process group when none exists (``fsdp`` on one process); True if started
    here (the caller destroys it with :func:`end_process_group`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is (the root of) an FSDP2-sharded model."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _layer_classes(model: Any, settings: FSDPSettings) -> set[str]:
    names = settings.layer_classes or list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        from grpo_plugins.errors import TrainingError

        raise TrainingError(
            f"fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules); "
            "set fsdp.layer_classes, e.g. [LlamaDecoderLayer]"
        )
    return set(names)


def shard_model(
    model: torch.nn.Module,
    settings: FSDPSettings,
    device: torch.device,
    num_processes: int,
    *,
    compute_dtype: torch.dtype | None = None,
) -> int:
    """Shard ``model`` in place over all processes: each decoder layer, then the root. Returns
    the number of layers sharded.

    Args:
        model: a transformers causal LM (on the CPU or ``device``).
        settings: the ``fsdp`` settings.
        device: this process's device (the mesh's device type).
        num_processes: the processes to shard over (all of them).
        compute_dtype: keep the shards in float32 and gather them in this dtype for forward and
            backward (gradients are reduced in float32); None: shard in the model's own dtype.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (num_processes,))
    mp = MixedPrecisionPolicy()
    if compute_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    classes = _layer_classes(model, settings)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        from grpo_plugins.errors import TrainingError

        raise TrainingError(f"fsdp: the model has no module of the classes {sorted(classes)} (fsdp.layer_classes)")
    for layer in layers:  # one layer at a time: only one layer is ever upcast and unsharded at once
        if compute_dtype is not None:
            layer.float()
        layer.to(device)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=settings.reshard_after_forward)
    if compute_dtype is not None:
        model.float()
    model.to(device)
    # The root (embeddings, final norm, LM head) stays gathered between forward and backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model._grpo_reshard_after_forward = settings.reshard_after_forward  # restored by gathered()
    model._grpo_compute_dtype = compute_dtype
    return len(layers)


def _reshard_setting(module: Any, root: Any) -> bool:
    """What :func:`shard_model` set: the root keeps its weights until backward, layers as configured."""
    return module is not root and getattr(root, "_grpo_reshard_after_forward", True)


@contextlib.contextmanager
def gathered(*models: Any) -> Iterator[None]:
    """Inside the block every sharded module of ``models`` (None and unsharded ones are skipped)
    holds its full weights, and forwards neither gather nor free them. Every process must enter
    and leave it together (the all-gathers are collective)."""
    roots = [m for m in models if m is not None and is_sharded(m)]
    if not roots:
        yield
        return
    modules = [(m, root) for root in roots for m in root.modules() if is_sharded(m)]
    for m, _ in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, root in modules:
            m.reshard()
            m.set_reshard_after_forward(_reshard_setting(m, root), recurse=False)


def _base_optimizer(optimizer: Any) -> Any:
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


def save_sharded(path: Path, model: Any, optimizer: Any, ref_model: Any = None) -> None:
    """Write model and optimizer state (and ``ref_model``'s) as ``torch.distributed.checkpoint``
    files under ``path`` (every process calls this; each writes its own shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, _base_optimizer(optimizer))
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    if ref_model is not None:
        state["ref_model"] = get_model_state_dict(ref_model)
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(path: Path, model: Any, optimizer: Any, ref_model: Any = None) -> None:
    """Load what :func:`save_sharded` wrote into ``model``, ``optimizer`` (and ``ref_model``),
    resharding for this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
    )

    base = _base_optimizer(optimizer)
    model_sd, optim_sd = get_state_dict(model, base)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    if ref_model is not None:
        state["ref_model"] = get_model_state_dict(ref_model)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, base, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ref_model is not None:
        set_model_state_dict(ref_model, state["ref_model"])


def compute_dtype(model: Any) -> torch.dtype | None:
    """The dtype a sharded model computes in when its shards are float32 masters, else None."""
    return getattr(model, "_grpo_compute_dtype", None)


def full_state_dict(model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on the CPU of the main process (every process calls this;
    the others get an empty dict), floating tensors cast to ``dtype`` when given."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embeddings is not None and head.weight is embeddings.weight:
        # Tied: save_pretrained of the model itself leaves the head out; so does this.
        for name, module in model.named_modules():
            if module is head:
                weights.pop(f"{name}.weight", None)
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    return weights
