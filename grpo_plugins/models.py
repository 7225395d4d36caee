"""Loading the policy model and its tokenizer: built-in GGUF models, GGUF files, local
directories or cached hub ids (never downloaded), or a random initialisation from a config;
then LoRA, gradient checkpointing and the other changes a run makes to the loaded model.
GGUF files are converted into ordinary checkpoints once (:mod:`grpo_plugins.gguf_import`).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import GRPOConfig, LoraSettings, ModelSpec
from grpo_plugins.errors import GRPOPluginsError, ModelLoadError
from grpo_plugins.gguf_import import (
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    apply_special_tokens,
    builtin_gguf_path,
    cache_root,
    convert_gguf,
    gguf_special_tokens,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PREFIX",
    "ModelLoadError",
    "apply_lora",
    "apply_special_tokens",
    "builtin_gguf_path",
    "cache_root",
    "cast_lm_head_to_fp32",
    "convert_gguf",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "gguf_special_tokens",
    "is_peft_model",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "model_source_problem",
    "policy_and_tokenizer",
    "prepare_tokenizer",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)


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
    train_vision_tower: bool = False,
    load_in_fp8: bool = False,
) -> tuple[PreTrainedModel, Any]:
    """Load a causal LM and its tokenizer, or a vision-language model (its config has a
    ``vision_config``) and its processor, ready for training.

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
        train_vision_tower: a vision-language model's vision encoder and projector train too
            (else they are frozen, and LoRA leaves them out).
        load_in_fp8: with ``lora``, the frozen linear layers multiply in float8
            (:mod:`grpo_plugins.fp8_base`), quantised on ``device`` (or the CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grpo_plugins import vision_models

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
            net_config = _config_from_spec(spec.config)
            vision = vision_models.config_is_vision(net_config)
            tokenizer = _tokenizer_or_processor(tok_source, tok_local, spec.trust_remote_code, vision)
            auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            net = auto.from_config(net_config, dtype=torch_dtype, **common)
        else:
            assert spec.name_or_path is not None
            source, local = _resolve_source(spec.name_or_path)
            if spec.tokenizer:
                tok_source, tok_local = _resolve_source(spec.tokenizer)
            else:
                tok_source, tok_local = source, local
            vision = bool(vision_models.local_config_is_vision(source))
            tokenizer = _tokenizer_or_processor(tok_source, tok_local, spec.trust_remote_code, vision)
            if spec.revision and not local:
                common["revision"] = spec.revision
            auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            net = _from_pretrained(auto, source, local, "model", dtype=torch_dtype, **common, **extra)
        text_tokenizer = vision_models.split_processor(tokenizer)[0]
        if getattr(net.config, "pad_token_id", None) is None:
            net.config.pad_token_id = text_tokenizer.pad_token_id
        if quantization_bits is not None:
            from grpo_plugins.quantization import quantize_model

            net = quantize_model(net, quantization_bits, torch_dtype, device if device is not None else "cpu")
        elif device is not None:
            net.to(device)
        if lora is not None:
            net = apply_lora(net, lora, train_vision_tower)
        elif vision and not train_vision_tower:
            vision_models.freeze_vision(net)
    if load_in_fp8:
        from grpo_plugins.fp8_base import use_float8_base

        use_float8_base(net)
    if gradient_checkpointing:
        enable_gradient_checkpointing(net, offload=activation_offload)
    return net, tokenizer


def _tokenizer_or_processor(source: str, local: bool, trust_remote_code: bool, vision: bool) -> Any:
    """A vision-language model's processor (its tokenizer prepared), else the tokenizer."""
    if not vision:
        return load_tokenizer(source, local=local, trust_remote_code=trust_remote_code)
    from grpo_plugins.vision_models import load_processor

    processor = load_processor(source, local=local, trust_remote_code=trust_remote_code)
    prepare_tokenizer(processor.tokenizer)
    return processor


def apply_lora(model: PreTrainedModel, lora: LoraSettings | Mapping[str, Any], train_vision_tower: bool = False) -> Any:
    """Wrap ``model`` with a peft LoRA adapter (``target_modules: all-linear`` by default); on a
    vision-language model the vision side gets none unless ``train_vision_tower``."""
    from peft import LoraConfig, get_peft_model

    from grpo_plugins.vision_models import is_vision_model, vision_module_pattern

    settings = lora if isinstance(lora, LoraSettings) else LoraSettings.model_validate(dict(lora))
    exclude = vision_module_pattern(model) if is_vision_model(model) and not train_vision_tower else None
    peft_config = LoraConfig(
        exclude_modules=exclude,
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
            # autocast_adapter_dtype=False leaves the adapters in the dtype of the layer they adapt.
            return get_peft_model(model, peft_config, autocast_adapter_dtype=settings.dtype == "float32")
    except ValueError as exc:
        raise ModelLoadError(f"lora.target_modules: {exc}") from exc


def enable_gradient_checkpointing(model: Any, offload: bool = False) -> None:
    """Non-reentrant activation checkpointing; with peft, inputs require grad so that
    checkpointed segments of a frozen base still pass gradients to the adapters.

    ``offload``: the checkpointed layers' inputs are kept in CPU memory
    (:class:`~grpo_plugins.offload.OffloadActivations` around each layer's checkpoint)."""
    from grpo_plugins.dropout import dropout_in

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Without dropout a recomputed segment draws nothing: no random state to save and restore.
    kwargs = {"use_reentrant": False, "preserve_rng_state": dropout_in(model) is not None}
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
        train_vision_tower=config.train_vision_tower,
        load_in_fp8=config.load_in_fp8,
    )


def policy_and_tokenizer(
    config: GRPOConfig, model: Any = None, tokenizer: Any = None, device: Any = None
) -> tuple[Any, PreTrainedTokenizerBase, Any]:
    """The model to train, its tokenizer and its processor (a vision-language model's, else
    None): loaded from ``config.model``, or the given ones (``tokenizer`` may be a processor) with
    the config's quantisation (unless already quantised), LoRA (unless already a peft model) and
    gradient checkpointing applied. ``device``: where a quantised model is quantised (the
    training device); others are moved there later by accelerate."""
    from grpo_plugins.vision_models import freeze_vision, is_vision_model, split_processor

    bits = config.quantization_bits
    if model is None:
        quantises = bits is not None or config.load_in_fp8
        model, loaded = load_model_and_tokenizer(config, device=device if quantises else None)
        return (model, *split_processor(loaded))
    tokenizer, processor = split_processor(tokenizer)
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
        model = apply_lora(model, config.lora, config.train_vision_tower)
    elif config.lora is None and is_vision_model(model) and not config.train_vision_tower:
        freeze_vision(model)
    if config.load_in_fp8:
        from grpo_plugins.fp8_base import use_float8_base

        use_float8_base(model)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model, offload=config.activation_offload)
    return model, tokenizer, processor


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
