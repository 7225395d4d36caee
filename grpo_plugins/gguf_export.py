"""Writing a merged policy as a GGUF file (for llama.cpp, Ollama, LM Studio) with the ``gguf`` package.

Supported: the decoders the static generator supports (``llama``, ``mistral`` -- written as llama.cpp
does, as architecture ``llama`` --, ``qwen2``, ``qwen3``) with a byte-level BPE tokenizer (GPT-2
style: SmolLM2, Qwen2/2.5/3, Llama 3) or a sentencepiece-style BPE tokenizer with byte fallback
(Llama 2, Mistral). Tensor names come from gguf's own name map (the one transformers' GGUF loader
inverts); llama's query and key rows are permuted into llama.cpp's rotary layout, as
``convert_hf_to_gguf.py`` does. Weight matrices are written as ``f16``, ``bf16`` or ``q8_0``
(gguf's quantizer; a matrix whose rows are not a multiple of the 32-value block falls back to
``f16``); norms and biases stay float32. The tokenizer goes in as llama.cpp's metadata (tokens,
types, merges, special token ids, chat template), so transformers'
``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` and llama.cpp rebuild it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.files import as_ordinary

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: model_type -> GGUF architecture name (llama.cpp writes Mistral as llama).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

#: --gguf-type -> (GGML type name of the weight matrices, llama.cpp file type name)
GGUF_TYPES = {"f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}


class GGUFExportError(GRPOPluginsError):
    """The model or its tokenizer cannot be written as GGUF."""


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise GGUFExportError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, not '{gguf_type}'")


def check_supported(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise :class:`GGUFExportError` (saying why and what to do) unless ``model`` and
    ``tokenizer`` can be written as GGUF."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    fallback = "export the transformers checkpoint (--out) and convert it with llama.cpp's convert_hf_to_gguf.py"
    if model_type not in GGUF_ARCHITECTURES:
        raise GGUFExportError(
            f"GGUF export supports model types {sorted(GGUF_ARCHITECTURES)}, not '{model_type}'; {fallback}"
        )
    scaling = _rope_scaling(config)
    if scaling is not None:
        raise GGUFExportError(
            f"GGUF export does not write rope scaling ({scaling.get('rope_type') or scaling.get('type')}) "
            f"of this {model_type} model; {fallback}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
        window = config.sliding_window
        if window < getattr(config, "max_position_embeddings", 0):
            raise GGUFExportError(
                f"GGUF export does not write sliding-window attention (window {window}); {fallback}"
            )
    tokenizer_model(tokenizer)  # raises for a tokenizer GGUF cannot describe


def _rope_scaling(config: Any) -> dict[str, Any] | None:
    """The model's rope scaling, or None when it uses plain RoPE."""
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            kind = value.get("rope_type") or value.get("type")
            if kind not in (None, "default"):
                return value
    return None


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


# -- tokenizer ---------------------------------------------------------------------------------------


def _tokenizer_json(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(
            f"GGUF export needs a fast tokenizer (tokenizer.json); {type(tokenizer).__name__} is not one"
        )
    return json.loads(backend.to_str())


def _components(node: Any, kind: str) -> list[dict[str, Any]]:
    """Every component of type ``kind`` in a tokenizers pre-tokenizer/decoder tree."""
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("type") == kind else []
    for child in node.get("pretokenizers", []) + node.get("decoders", []):
        found += _components(child, kind)
    return found


def tokenizer_model(tokenizer: PreTrainedTokenizerBase) -> str:
    """llama.cpp's tokenizer model for ``tokenizer``: ``gpt2`` (byte-level BPE) or ``llama``
    (sentencepiece-style BPE with byte fallback)."""
    data = _tokenizer_json(tokenizer)
    model = data.get("model", {})
    byte_level = bool(_components(data.get("pre_tokenizer"), "ByteLevel") or _components(data.get("decoder"), "ByteLevel"))
    if model.get("type") == "BPE" and byte_level and not model.get("byte_fallback"):
        return "gpt2"
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return "llama"
    raise GGUFExportError(
        f"GGUF export supports byte-level BPE tokenizers (GPT-2 style, as SmolLM2, Qwen and Llama 3 use) and "
        f"sentencepiece-style BPE tokenizers with byte fallback (Llama 2, Mistral); this one is a "
        f"{model.get('type')} tokenizer{' without byte-level encoding' if model.get('type') == 'BPE' else ''}. "
        "Export the transformers checkpoint (--out) instead"
    )


def _pre_tokenizer_name(data: dict[str, Any]) -> str:
    """llama.cpp's name for a byte-level tokenizer's pre-tokenizer (how text is split before BPE)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    splits = [c.get("pattern", {}).get("Regex") for c in _components(data.get("pre_tokenizer"), "Split")]
    for name in ("qwen2", "llama-bpe"):  # the first llama.cpp name for each pattern
        if GGUF_PRE_TOKENIZER_SPLITS[name] in splits:
            return name
    if _components(data.get("pre_tokenizer"), "Digits"):  # SmolLM's: digits split, then GPT-2's regex
        return "smollm"
    return "default"


def _merges(data: dict[str, Any]) -> list[str]:
    merges = data.get("model", {}).get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def tokenizer_metadata(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> dict[str, Any]:
    """The GGUF tokenizer metadata of ``tokenizer`` padded to the model's ``vocab_size`` rows, as
    llama.cpp's converter writes it: model, pre-tokenizer, tokens, scores, token types, merges,
    special token ids, whether BOS is added, and the chat template."""
    from gguf import TokenType

    kind = tokenizer_model(tokenizer)
    data = _tokenizer_json(tokenizer)
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size:
        raise GGUFExportError(
            f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embedding rows"
        )
    by_id = {index: token for token, index in vocab.items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    tokens: list[str] = []
    types: list[int] = []
    scores: list[float] = []
    for index in range(vocab_size):
        if index not in by_id:  # embedding rows beyond the vocabulary (padding for speed)
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        else:
            token = by_id[index]
            tokens.append(token)
            if kind == "llama" and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                types.append(TokenType.BYTE)  # byte fallback needs them typed so, even if "added"
            elif index in added:
                types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
            else:
                types.append(TokenType.NORMAL)
        scores.append(-float(index) if kind == "llama" else 0.0)  # sentencepiece BPE: earlier merges first
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    meta: dict[str, Any] = {
        "model": kind,
        "pre": _pre_tokenizer_name(data) if kind == "gpt2" else "default",
        "tokens": tokens,
        "scores": scores,
        "types": [int(t) for t in types],
        "merges": _merges(data),
        "add_bos": bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id,
        "add_eos": bool(probe) and tokenizer.eos_token_id is not None and probe[-1] == tokenizer.eos_token_id,
        "special": {
            role: getattr(tokenizer, f"{role}_token_id")
            for role in ("bos", "eos", "unk", "pad")
            if getattr(tokenizer, f"{role}_token_id", None) is not None
        },
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
    }
    return meta


def _add_tokenizer(writer: Any, meta: dict[str, Any]) -> None:
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_scores(meta["scores"])
    writer.add_token_types(meta["types"])
    if meta["merges"]:
        writer.add_token_merges(meta["merges"])
    for role, token_id in meta["special"].items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_add_eos_token(meta["add_eos"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])


# -- tensors -----------------------------------------------------------------------------------------


def permute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder a query/key projection's rows (or bias) from transformers' rotary layout (halves)
    to llama.cpp's (interleaved pairs), as convert_hf_to_gguf.py's ``LlamaModel.permute``."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_tensors(model: PreTrainedModel) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight of ``model``, in llama.cpp's layout, one at a
    time (so a large model is never copied whole)."""
    import gguf

    config = model.config
    arch_name = GGUF_ARCHITECTURES[config.model_type]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n_head, n_kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the embedding when there is no output.weight
        if "rotary_emb" in hf_name:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = name_map.get_name(base)
        if name is None:
            raise GGUFExportError(f"no GGUF name for the weight '{hf_name}' of this {config.model_type} model")
        data = tensor.detach().to("cpu").float().numpy()
        if arch_name == "llama" and name.endswith("attn_q"):
            data = permute_rotary(data, n_head)
        elif arch_name == "llama" and name.endswith("attn_k"):
            data = permute_rotary(data, n_kv)
        yield f"{name}.{suffix}", data


def _encode(data: np.ndarray, gguf_type: str) -> tuple[np.ndarray, Any]:
    """(data, GGML type) for one tensor: matrices in ``gguf_type``, vectors in float32."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if data.ndim < 2:
        return data.astype(np.float32), GGMLQuantizationType.F32
    qtype = GGMLQuantizationType[GGUF_TYPES[gguf_type][0]]
    if qtype == GGMLQuantizationType.Q8_0 and data.shape[-1] % 32 != 0:
        qtype = GGMLQuantizationType.F16  # rows must hold whole 32-value blocks
    return quants.quantize(data, qtype), qtype


def write_gguf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str], gguf_type: str = "f16") -> Path:
    """Write ``model`` (a plain, merged transformers model) and ``tokenizer`` as a GGUF file at
    ``path`` (atomically: a temporary file in the same folder, then renamed)."""
    import gguf

    check_gguf_type(gguf_type)
    check_supported(model, tokenizer)
    config = model.config
    arch_name = GGUF_ARCHITECTURES[config.model_type]
    vocab_size = model.get_input_embeddings().weight.shape[0]
    meta = tokenizer_metadata(tokenizer, vocab_size)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    as_ordinary(tmp)
    try:
        # use_temp_file: each tensor is encoded and spooled to disk as it is added, not kept in memory.
        writer = gguf.GGUFWriter(str(tmp), arch_name, use_temp_file=True)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(getattr(config, "model_type", arch_name) + " (grpo-plugins export)")
        writer.add_context_length(int(config.max_position_embeddings))
        writer.add_embedding_length(int(config.hidden_size))
        writer.add_block_count(int(config.num_hidden_layers))
        writer.add_feed_forward_length(int(config.intermediate_size))
        writer.add_head_count(int(config.num_attention_heads))
        writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_rope_freq_base(_rope_theta(config))
        head_dim = _head_dim(config)
        writer.add_rope_dimension_count(head_dim)
        if head_dim != config.hidden_size // config.num_attention_heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_vocab_size(int(vocab_size))
        writer.add_file_type(int(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(writer, meta)
        for name, data in gguf_tensors(model):
            encoded, qtype = _encode(data, gguf_type)
            writer.add_tensor(name, encoded, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path

