"""Checkpoints: written atomically, found again, and loaded for an exact resume.

Layout of ``<output_dir>/checkpoints/checkpoint-<step>/``::

    model/               save_pretrained of the model, or of the LoRA adapter only (+ tokenizer)
    optimizer.pt         optimizer state
    sharded/             FSDP runs instead of optimizer.pt (and ref_model.pt): model, optimizer
                         (and reference) state as torch.distributed.checkpoint shards, loadable
                         on any number of processes
    scheduler.pt         LR-scheduler state
    rng_state_<rank>.pt  python, numpy, torch (and CUDA) RNG states of each process
    rollout_<rank>.pt    a process's generation batch, only when saved in the middle of a cycle
    ahead_<rank>.pt      a process's next generation batch, made beside training (generate_ahead)
    master_weights.pt    float32 master copies of 16-bit trainable weights (when the run keeps them)
    config.yaml          the run config
    trainer_state.json   step, data position and counters; written last

A checkpoint is built in ``.tmp-checkpoint-<step>`` and renamed into place with ``os.replace``,
so a killed run never leaves a half-written ``checkpoint-<step>`` behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.files import as_ordinary_tree

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(GRPOPluginsError):
    """A checkpoint to resume from is missing or does not fit the run."""


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and _is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def _is_complete(checkpoint: Path) -> bool:
    """Its completion marker (the trainer state, written last) exists and reads back."""
    try:
        return isinstance(json.loads((checkpoint / STATE_FILE).read_text()), dict)
    except (OSError, ValueError):
        return False


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def earlier_run(output_dir: str | Path) -> list[str]:
    """What of an earlier run ``output_dir`` holds: its newest checkpoint's name and a non-empty
    ``metrics.jsonl``; empty when there is none. A fresh run there would delete or overwrite them."""
    from grpo_plugins.metrics import METRICS_FILE

    found = []
    latest = latest_checkpoint(output_dir)
    if latest is not None:
        found.append(f"{CHECKPOINTS_DIR}/{latest.name}")
    metrics = Path(output_dir) / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_FILE)
    return found


def refuse_fresh_run_over(output_dir: str | Path) -> None:
    """Raise :class:`CheckpointError` when ``output_dir`` holds an earlier run (see
    :func:`earlier_run`): a fresh run would rotate that run's checkpoints against its own and
    overwrite its metrics."""
    found = earlier_run(output_dir)
    if found:
        raise CheckpointError(
            f"output_dir '{output_dir}' already holds an earlier run ({', '.join(found)}); continue it "
            "with --resume (train(resume=True) in Python), or start a fresh run in another folder "
            f"(--set output_dir=...), or delete '{output_dir}' first"
        )


def resolve_resume(resume: str | Path | bool | None, output_dir: str | Path) -> Path | None:
    """The checkpoint directory that ``resume`` names.

    ``None``/``False``: none. ``True``: the latest in ``output_dir``. A path: that checkpoint,
    or the latest inside it when it is a run's output directory.
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(
                f"resume: no checkpoint found in {checkpoints_root(output_dir)}; "
                "start without --resume, or give the checkpoint's path"
            )
        return found
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"resume: '{path}' is neither a checkpoint (no {STATE_FILE}) nor an output directory "
            "with checkpoints"
        )
    return found


# -- RNG ------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process (python, numpy, torch CPU, every CUDA device)."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- saving ---------------------------------------------------------------------------------------


def save_checkpoint(
    accelerator: Any,
    output_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: Any,
    scheduler: Any,
    rng_state: dict[str, Any],
    rollout: dict[str, Any] | None,
    state: dict[str, Any],
    config_yaml: str,
    save_total_limit: int | None,
    scaler: Any = None,
    master_weights: Any = None,
    ref_model: Any = None,
    ahead: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically (every process calls this) and prune old ones.

    ``ref_model`` (with ``sync_ref_model``, where the reference changes) is saved too.

    Args:
        model: the unwrapped model (a peft model saves its adapter only).
        rng_state: this process's RNG states to resume with.
        rollout: this process's generation batch when saved mid-cycle, else None.
        ahead: this process's generation of the next cycle when one is pending (``generate_ahead``).
        state: JSON-serialisable trainer state (step, data position, counters).
        scaler: the float16 gradient scaler, if any (its scale and growth tracker are saved so
            that a resumed run skips exactly the steps an uninterrupted one would).
        master_weights: the float32 master copies of 16-bit weights, if any (``precision``);
            saved so that a resumed run keeps the fractions the 16-bit weights round away.
    """
    import torch

    from grpo_plugins.sharding import SHARDED_DIR, compute_dtype, full_state_dict, is_sharded, save_sharded

    root = checkpoints_root(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}"
    main = accelerator.is_main_process
    if main:
        if tmp.exists():  # left by a killed run
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    rank = accelerator.process_index
    torch.save(rng_state, tmp / f"rng_state_{rank}.pt")
    if rollout is not None:
        torch.save(rollout, tmp / f"rollout_{rank}.pt")
    if ahead is not None:
        torch.save(ahead, tmp / f"ahead_{rank}.pt")
    sharded = is_sharded(model)
    full_weights = None
    if sharded:  # collective: every process writes its shards, the main one gets full weights
        save_sharded(tmp / SHARDED_DIR, model, optimizer, ref_model)
        full_weights = full_state_dict(model, compute_dtype(model))
    accelerator.wait_for_everyone()
    if main:
        model.save_pretrained(str(tmp / "model"), safe_serialization=True, state_dict=full_weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "model"))
        if not sharded:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        if master_weights is not None:
            torch.save(master_weights.state_dict(), tmp / "master_weights.pt")
        if ref_model is not None and not sharded:  # sync_ref_model: the reference moves during training
            torch.save(ref_model.state_dict(), tmp / "ref_model.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        trash = root / f".old-checkpoint-{step}"
        if final.exists():  # the same step saved again (e.g. after a resume)
            if trash.exists():
                shutil.rmtree(trash)
            os.replace(final, trash)
        as_ordinary_tree(tmp)  # safetensors writes its files as 0600 whatever the umask
        _fsync_tree(tmp)  # the rename must not become visible before the contents are on disk
        os.replace(tmp, final)
        _fsync_dir(root)
        if trash.exists():
            shutil.rmtree(trash)
        if save_total_limit is not None:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (so a power loss cannot leave a checkpoint
    that looks complete but holds truncated files)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


# -- loading --------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path,
    accelerator: Any,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: Any = None,
    master_weights: Any = None,
    ref_model: Any = None,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Load weights, optimizer and scheduler state in place.

    Returns (trainer state, this process's RNG state or None, its mid-cycle rollout or None).
    """
    import torch

    from grpo_plugins.sharding import SHARDED_DIR, is_sharded, load_sharded

    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    if (path / SHARDED_DIR).is_dir():
        if master_weights is not None:
            raise CheckpointError(
                f"{path} was saved by an fsdp run (float32 shards); resume it with fsdp, or with "
                "master_weights: false"
            )
        load_sharded(path / SHARDED_DIR, model, optimizer, ref_model)
        ref_model = None
    elif is_sharded(model):
        raise CheckpointError(f"{path} was saved without fsdp; resume it without fsdp (DDP or one process)")
    else:
        load_weights(path / "model", model)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
    if scaler is not None and (path / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(path / "scaler.pt", map_location="cpu", weights_only=False))
    if master_weights is not None:
        masters = path / "master_weights.pt"
        if masters.is_file():
            master_weights.load_state_dict(torch.load(masters, map_location="cpu", weights_only=False))
        else:  # saved without master weights: start them from the saved 16-bit weights
            master_weights.params_to_masters()
    if ref_model is not None and (path / "ref_model.pt").is_file():
        ref_model.load_state_dict(torch.load(path / "ref_model.pt", map_location="cpu", weights_only=True))
    rank = accelerator.process_index
    rng_file = path / f"rng_state_{rank}.pt"
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    rollout_file = path / f"rollout_{rank}.pt"
    rollout = torch.load(rollout_file, map_location="cpu", weights_only=False) if rollout_file.is_file() else None
    if state.get("mid_cycle") and rollout is None:
        raise CheckpointError(
            f"{path} was saved in the middle of a generation cycle by {state.get('num_processes')} "
            f"processes and has no rollout for process {rank}; resume with the same number of processes"
        )
    return state, rng, rollout


def load_ahead(path: str | Path, rank: int) -> dict[str, Any] | None:
    """The generation of the next cycle that process ``rank`` saved as pending, or None."""
    import torch

    file = Path(path) / f"ahead_{rank}.pt"
    return torch.load(file, map_location="cpu", weights_only=False) if file.is_file() else None


def load_weights(model_dir: Path, model: Any) -> None:
    """Load what ``save_pretrained`` wrote into ``model`` (an adapter into a peft model)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        adapter = model_dir / "adapter_model.safetensors"
        if not adapter.is_file():
            raise CheckpointError(f"{model_dir} has no LoRA adapter (adapter_model.safetensors) to resume")
        result = set_peft_model_state_dict(model, load_file(str(adapter)))
        unexpected = getattr(result, "unexpected_keys", None) or []
        if unexpected:
            raise CheckpointError(f"{adapter} does not fit the model: unexpected keys {unexpected[:5]}")
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no model weights (*.safetensors) to resume")
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(load_file(str(file)))
    own = _own_names(model)
    weights = {own.get(k, k): v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    missing = [k for k in missing if k not in set(tied)]
    if missing or unexpected:
        raise CheckpointError(
            f"{model_dir} does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def _own_names(model: Any) -> dict[str, str]:
    """``save_pretrained``'s name of each weight -> the model's own, where they differ:
    transformers saves some models (e.g. vision-language ones) under their original checkpoint
    names. Renamed weights are the very tensors, so they are matched by identity."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers saves the model's own names
        return {}
    state = model.state_dict()
    try:
        saved = revert_weight_conversion(model, dict(state))
    except Exception:  # noqa: BLE001 - a model without conversions, or one transformers cannot revert
        return {}
    by_tensor = {id(t): name for name, t in state.items()}
    return {name: by_tensor[id(t)] for name, t in saved.items() if id(t) in by_tensor and by_tensor[id(t)] != name}
