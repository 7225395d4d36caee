"""Tiny random models and a local tokenizer for tests: no network, no hub.

* :func:`build_tiny_tokenizer` writes a character-level tokenizer (with a chat template) to a
  directory, built locally with the ``tokenizers`` library.
* :func:`tiny_model_config` is a transformers config dict for a tiny random Llama or Qwen2.
* :func:`tiny_model_spec` gives the ``model:`` mapping of a run config for both together.
* :func:`build_tiny_bpe_tokenizer` writes a small byte-level BPE tokenizer (GPT-2/Qwen2 style, as
  real models use), trained locally, for code that needs a real BPE vocabulary (GGUF export).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]


def _tiny_vocab() -> list[str]:
    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    return [PAD, BOS, EOS, *_ROLE_TOKENS, "<unk>", *chars]


def build_tiny_tokenizer(directory: str | Path) -> Path:
    """Write a character-level ``PreTrainedTokenizerFast`` to ``directory`` and return it.

    Vocabulary: pad (0), bos (1), eos (2), three chat-role tokens, unk, then printable ASCII; about
    100 ids in all.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(_tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS, *_ROLE_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(str(directory))
    return directory


#: Text the tiny BPE tokenizer learns its merges from (fixed, so its vocabulary is reproducible).
_BPE_CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Compute 3 * 4 and explain: 3 * 4 = 12.",
    "The quick brown fox jumps over the lazy dog.",
    "GRPO samples a group of completions and compares their rewards.",
    "<answer>42</answer> is the final answer.",
] * 4


def build_tiny_bpe_tokenizer(directory: str | Path, vocab_size: int = 360) -> Path:
    """Write a byte-level BPE ``PreTrainedTokenizerFast`` (Qwen2's pre-tokenizer split, then GPT-2's
    byte alphabet) trained on a fixed text to ``directory`` and return it.

    Special tokens pad (0), bos (1), eos (2) and the three chat-role tokens come first; then the
    256 byte symbols and the learned merges, ``vocab_size`` ids in all. It has
    :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, *_ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_BPE_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(str(directory))
    return directory


def tiny_vocab_size() -> int:
    """The number of ids of :func:`build_tiny_tokenizer`'s vocabulary."""
    return len(_tiny_vocab())


def tiny_model_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A transformers config dict for a tiny random model matching :func:`build_tiny_tokenizer`."""
    base: dict[str, Any] = {
        "vocab_size": tiny_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        base.update(model_type="llama", architectures=["LlamaForCausalLM"])
    elif arch == "qwen2":
        base.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    else:
        raise ValueError(f"unknown tiny architecture '{arch}' (llama or qwen2)")
    base.update(overrides)
    return base


def tiny_model_spec(directory: str | Path, arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The ``model:`` mapping of a run config for a tiny random model (tokenizer written to
    ``directory``)."""
    tok_dir = build_tiny_tokenizer(Path(directory) / "tokenizer")
    config_path = Path(directory) / "config.json"
    config_path.write_text(json.dumps(tiny_model_config(arch, **overrides)))
    return {"config": str(config_path), "tokenizer": str(tok_dir)}
