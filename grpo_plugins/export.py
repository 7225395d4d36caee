"""Export a trained policy: a standard transformers checkpoint with the LoRA adapter merged.

``grpo-plugins export RUN_OR_CHECKPOINT --out DIR`` finds the checkpoint (a run's output
directory means its latest one), rebuilds the policy exactly as the run trained it (the base
model named in the checkpoint's ``config.yaml`` plus the saved adapter, or the saved full
weights), merges the adapter into the weights (peft's ``merge_and_unload``) and writes plain
safetensors, a ``config.json`` without peft or quantization leftovers, the generation config,
and the tokenizer with its chat template. The folder loads with
``AutoModelForCausalLM.from_pretrained`` and serves with vLLM. ``--gguf FILE`` also writes a GGUF
file (:mod:`grpo_plugins.gguf_export`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.checkpoint import STATE_FILE, latest_checkpoint
from grpo_plugins.console import quiet_libraries
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.files import as_ordinary_tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: ``--dtype`` choices; ``auto`` keeps the dtype the run trained in (float32 when that was ``auto``).
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")

#: config.json keys that describe how a model was trained or loaded, not the model itself.
_CONFIG_LEFTOVERS = ("quantization_config", "_name_or_path")


class ExportError(GRPOPluginsError):
    """A run or checkpoint that cannot be exported, or an output that cannot be written."""


@dataclass
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        checkpoint: the checkpoint that was exported.
        out: the transformers checkpoint directory (None when not asked for).
        gguf: the GGUF file (None when not asked for).
        merged_lora: whether a LoRA adapter was merged into the weights.
        dtype: the dtype of the written weights.
    """

    checkpoint: Path
    out: Path | None
    gguf: Path | None
    merged_lora: bool
    dtype: str


def find_checkpoint(source: str | os.PathLike[str]) -> Path:
    """The checkpoint that ``source`` names: a checkpoint directory, its ``model`` folder, or a run's
    output directory (its latest complete checkpoint)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ExportError(f"'{path}' does not exist; give a run's output directory or one of its checkpoints")
    for candidate in (path, path.parent):
        if (candidate / STATE_FILE).is_file() and (candidate / "model").is_dir():
            return candidate
    found = latest_checkpoint(path)
    if found is None:
        raise ExportError(
            f"'{path}' is neither a checkpoint (checkpoints/checkpoint-<step>) nor a run's output directory "
            "with a complete checkpoint; a run writes one every save_steps and at its end"
        )
    return found


def load_policy(checkpoint: str | os.PathLike[str]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]:
    """The policy saved in ``checkpoint`` as a plain float32 transformers model (a LoRA adapter is
    merged into its base), its tokenizer, and whether an adapter was merged."""
    import torch

    from grpo_plugins.checkpoint import load_weights
    from grpo_plugins.config import load_config
    from grpo_plugins.models import load_model, load_tokenizer

    checkpoint = Path(checkpoint)
    model_dir = checkpoint / "model"
    config_file = checkpoint / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{checkpoint} has no config.yaml (the run config it was trained with)")
    config = load_config(config_file)
    is_adapter = (model_dir / "adapter_config.json").is_file()
    if is_adapter:
        if config.lora is None:
            raise ExportError(f"{model_dir} holds a LoRA adapter but {config_file} has no lora settings")
        # The base as the run built it (same source, same seed for a random initialisation).
        model, _ = load_model(config.model, dtype="float32", lora=config.lora, seed=config.seed)
        try:
            load_weights(model_dir, model)
        except (GRPOPluginsError, RuntimeError) as exc:  # RuntimeError: torch's size mismatch
            raise ExportError(
                f"{exc}. The adapter does not fit the base model that {config_file} names ({_model_name(config)}); "
                "a run started from Python with Engine(model=...) trained another base: merge it there "
                "with peft (PeftModel.from_pretrained(base, ADAPTER_DIR).merge_and_unload())"
            ) from exc
        model = model.merge_and_unload()
    else:
        if not any(model_dir.glob("*.safetensors")):
            raise ExportError(f"{model_dir} holds neither model weights (*.safetensors) nor a LoRA adapter")
        model, _ = load_model(str(model_dir), dtype="float32")
    try:
        tokenizer = load_tokenizer(str(model_dir))
    except GRPOPluginsError as exc:
        raise ExportError(f"{model_dir} has no readable tokenizer (checkpoints save it next to the weights): {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    if model.dtype != torch.float32:
        model.to(torch.float32)
    return model, tokenizer, is_adapter


def _model_name(config: Any) -> str:
    spec = config.model
    if isinstance(spec, str):
        return f"model: {spec}"
    return f"model: {spec.name_or_path or 'a random initialisation from model.config'}"


def export_dtype(requested: str, checkpoint: Path) -> str:
    """The dtype to write: ``requested``, or for ``auto`` the run's ``dtype`` (float32 when the run
    said ``auto``, since where it ran is not recorded)."""
    if requested not in EXPORT_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, not '{requested}'")
    if requested != "auto":
        return requested
    import yaml

    try:
        trained = (yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}).get("dtype", "auto")
    except (OSError, yaml.YAMLError):
        trained = "auto"
    return trained if trained in EXPORT_DTYPES[1:] else "float32"


def clean_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make ``model.config`` describe a plain inference checkpoint: no quantization or training
    leftovers, the KV cache on (training turns it off for gradient checkpointing), and the
    tokenizer's special token ids."""
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = ""
    config.use_cache = True
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None and getattr(config, f"{role}_token_id", None) is None:
            setattr(config, f"{role}_token_id", token_id)


def check_out_folder(out: Path, *, overwrite: bool) -> None:
    """Raise :class:`ExportError` when ``out`` exists and is not empty (unless ``overwrite``)."""
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out '{out}' exists and is not empty; choose a new folder or pass --overwrite")


def save_checkpoint_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, *, overwrite: bool) -> None:
    """Write model and tokenizer to ``out`` atomically (built in a sibling folder, then renamed)."""
    out = out.expanduser()
    check_out_folder(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _strip_saved_config(tmp / "config.json")
        as_ordinary_tree(tmp)  # mkdtemp's folder and safetensors' file are private (0700 / 0600)
        trash = out.with_name(f".{out.name}.old")
        if out.exists():
            if trash.exists():
                shutil.rmtree(trash)
            os.replace(out, trash)
        os.replace(tmp, out)
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _strip_saved_config(path: Path) -> None:
    """Remove keys that save_pretrained may still write and that vLLM would misread."""
    data = json.loads(path.read_text())
    changed = False
    for key in _CONFIG_LEFTOVERS:
        if key in data:
            del data[key]
            changed = True
    if changed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


@quiet_libraries()
def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    gguf: str | os.PathLike[str] | None = None,
    gguf_type: str = "f16",
    dtype: str = "auto",
    overwrite: bool = False,
) -> ExportResult:
    """Export the policy of a run or checkpoint (the ``grpo-plugins export`` command).

    Args:
        source: a run's output directory (its latest checkpoint) or a checkpoint directory.
        out: folder for the merged transformers checkpoint (None: do not write one).
        gguf: GGUF file to write (None: do not write one).
        gguf_type: ``f16``, ``bf16`` or ``q8_0`` for the GGUF's weight matrices.
        dtype: dtype of the transformers checkpoint (``auto``: the dtype the run trained in).
        overwrite: replace a non-empty ``out`` folder or an existing GGUF file.
    """
    import torch

    from grpo_plugins import gguf_export

    if out is None and gguf is None:
        raise ExportError("nothing to write: give --out DIR, --gguf FILE, or both")
    gguf_path = Path(gguf).expanduser() if gguf is not None else None
    if gguf_path is not None:
        gguf_export.check_gguf_type(gguf_type)
        if gguf_path.exists() and not overwrite:
            raise ExportError(f"--gguf '{gguf_path}' exists; choose a new file or pass --overwrite")
    if out is not None:
        check_out_folder(Path(out).expanduser(), overwrite=overwrite)  # before the model loads
    checkpoint = find_checkpoint(source)
    out_dtype = export_dtype(dtype, checkpoint)
    model, tokenizer, merged = load_policy(checkpoint)
    clean_config(model, tokenizer)
    if gguf_path is not None:
        gguf_export.check_supported(model, tokenizer)  # before anything is written
        gguf_export.write_gguf(model, tokenizer, gguf_path, gguf_type)  # from the float32 weights
    out_path = None
    if out is not None:
        out_path = Path(out).expanduser()
        model.to({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[out_dtype])
        save_checkpoint_dir(model, tokenizer, out_path, overwrite=overwrite)
    return ExportResult(checkpoint=checkpoint, out=out_path, gguf=gguf_path, merged_lora=merged, dtype=out_dtype)
