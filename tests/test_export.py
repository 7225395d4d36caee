"""``grpo-plugins export``: a merged transformers checkpoint whose logits equal the trained policy's,
and a GGUF file that transformers' GGUF loader reads back (weights and tokenizer)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.cli import main
from grpo_plugins.testing import build_tiny_bpe_tokenizer, tiny_model_config

PROMPTS = [{"prompt": p} for p in ["What is 1 + 2?", "The quick", "brown fox", "Compute 3 * 4"]]
TEXT = "What is 12 + 7? The answer is 19, and the quick brown fox"
#: Largest logit error, relative to the logits' range, after a GGUF round trip (measured on these
#: tiny models: f16 6e-4, bf16 5e-3, q8_0 1.5e-2; a missing llama rotary permutation gives 0.48).
GGUF_TOLERANCE = {"f16": 3e-3, "bf16": 2e-2, "q8_0": 5e-2}


def char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    """Varies between completions, so every group has an advantage signal."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.fixture(scope="module")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tokenizer")


def _bpe_model_spec(tmp: Path, tokenizer_dir: Path, arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    config = tmp / "config.json"
    config.write_text(json.dumps(tiny_model_config(arch, vocab_size=vocab, initializer_range=0.2, **overrides)))
    return {"config": str(config), "tokenizer": str(tokenizer_dir)}


def _train(model: dict[str, Any], output_dir: Path, lora: bool, **extra: Any) -> Any:
    from grpo_plugins.engine import Engine

    config = {
        "model": model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 2,
        "save_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 5e-2,
        "report_to": ["jsonl"],
        "dtype": "float32",
        "seed": 5,
    }
    if lora:
        config["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    engine = Engine({**config, **extra}, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    return engine


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (a.max() - a.min()))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_exported_checkpoint_has_the_trained_policys_logits(
    lora: bool, bpe_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = _train(_bpe_model_spec(tmp_path, bpe_tokenizer_dir), tmp_path / "run", lora)
    policy = engine.unwrapped.eval()
    out = tmp_path / "exported"
    gguf_file = tmp_path / "policy.gguf"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--gguf", str(gguf_file)]) == 0

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    expected = _logits(policy, ids)
    torch.testing.assert_close(_logits(exported, ids), expected, rtol=0, atol=1e-5)
    if lora:  # the adapter was trained, so merging it matters: the base model's logits differ
        with policy.disable_adapter():
            assert (_logits(policy, ids) - expected).abs().max() > 1e-3

    # A plain checkpoint: safetensors, no adapter files, no peft/quantization keys, cache on.
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and not [n for n in names if n.startswith("adapter_") or n.endswith(".bin")]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["use_cache"] is True
    assert not {"quantization_config", "base_model_name_or_path", "peft_type"} & set(config)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir)).chat_template

    # Both are as readable as anything else the user writes (umask 022 here): not the private
    # modes of the temporary names they were written under.
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE(gguf_file.stat().st_mode) == 0o666 & ~mask
    # Every file inside too: safetensors writes model.safetensors as 0600 whatever the umask.
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()} == {
        p.name: oct(0o666 & ~mask) for p in out.iterdir()
    }
    # And the run's checkpoints, which save_pretrained writes the same way.
    saved = tmp_path / "run" / "checkpoints" / "checkpoint-2" / "model"
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in saved.iterdir()} == {oct(0o666 & ~mask)}

    # The GGUF written alongside holds the same policy.
    from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_file.name, dtype=torch.float32)
    assert _relative_error(_logits(from_gguf.eval(), ids), expected) < GGUF_TOLERANCE["f16"]


@pytest.mark.slow
def test_a_qlora_run_is_merged_into_the_unquantised_base(bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_plugins.models import load_model

    spec = _bpe_model_spec(tmp_path, bpe_tokenizer_dir)
    with torch.compiler.set_stance("force_eager"):  # bitsandbytes' CPU path compiles per shape otherwise
        _train(spec, tmp_path / "run", lora=True, load_in_4bit=True)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0

    # Independently: the float32 base (same seed as the run) with the saved adapter, merged.
    base, tokenizer = load_model(spec, dtype="float32", seed=5)
    adapter = tmp_path / "run" / "checkpoints" / "checkpoint-2" / "model"
    expected_model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    torch.testing.assert_close(_logits(exported, ids), _logits(expected_model, ids), rtol=0, atol=1e-5)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert not [k for k in weights if "absmax" in k or "quant" in k]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2-tied"])
@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_gguf_round_trip_through_transformers(arch: str, gguf_type: str, bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.gguf_export import write_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    overrides: dict[str, Any] = {
        "vocab_size": len(tokenizer), "initializer_range": 0.2, "rope_theta": 5000.0, "rms_norm_eps": 1e-5,
    }
    if arch == "qwen3":  # transformers' GGUF loader assumes Qwen3's head_dim of 128
        overrides.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128)
    if arch == "qwen2-tied":
        overrides["tie_word_embeddings"] = True
    config = AutoConfig.for_model(**tiny_model_config(arch.split("-")[0] if arch != "qwen3" else "qwen2", **overrides))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", gguf_type)

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert loaded.config.model_type == config.model_type
    assert loaded.config.tie_word_embeddings == (arch == "qwen2-tied")
    assert loaded.config.rope_parameters["rope_theta"] == 5000.0
    assert loaded.config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)  # stored as float32
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    error = _relative_error(_logits(loaded, ids), _logits(model, ids))
    assert error < GGUF_TOLERANCE[gguf_type]
    if gguf_type == "f16":
        assert error > 0  # really read from the file (f16 rounds), not the model in memory


def test_gguf_tokenizer_reads_back_with_special_tokens_and_chat_template(bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.gguf_export import write_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    rows = len(tokenizer) + 4  # embedding rows beyond the vocabulary, as Qwen's
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_model_config("qwen2", vocab_size=rows)))
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16")

    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "What is 12 + 7?  The answer\n is <|user|>x</s> ünïcode"
    assert back(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (back.bos_token, back.eos_token, back.pad_token) == ("<s>", "</s>", "<pad>")
    messages = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    fields = GGUFReader(str(path)).fields
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "qwen2"
    assert len(fields["tokenizer.ggml.tokens"].data) == rows
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    assert types[:6] == [3] * 6 and types[-4:] == [5] * 4  # control (specials), unused (padding rows)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-2-style tokenizer: BPE with byte fallback over "▁"-marked words (as Mistral's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from grpo_plugins.testing.tiny import _BPE_CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(_BPE_CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False))
    directory = tmp_path_factory.mktemp("spm") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        str(directory)
    )
    return directory


def test_gguf_sentencepiece_style_tokenizer_reads_back(sentencepiece_tokenizer_dir: Path, tmp_path: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.gguf_export import write_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(sentencepiece_tokenizer_dir))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_model_config("llama", vocab_size=len(tokenizer))))
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16")

    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["What is 12 + 7? The answer", "ünï  x", "hello world"]:  # the last two need byte fallback
        assert back(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert back.decode(back(text)["input_ids"]) == text
    fields = GGUFReader(str(path)).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    assert types[:3] == [3] * 3 and types[3:259] == [6] * 256  # control (unk, bos, eos), then byte tokens


def test_gguf_of_a_character_tokenizer_is_refused_before_anything_is_written(
    tiny_model: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _train(tiny_model, tmp_path / "run", lora=True)
    out = tmp_path / "exported"
    code = main(["export", str(tmp_path / "run"), "--out", str(out), "--gguf", str(tmp_path / "m.gguf")])
    err = capsys.readouterr().err
    assert code == 2
    assert "GGUF export supports byte-level BPE tokenizers" in err and "WordLevel" in err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "m.gguf").exists()
    capsys.readouterr()
    # Without --gguf the same run exports.
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    assert main(["export", str(checkpoint), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()

    # A config naming another base than the adapter was trained on (as after Engine(model=...)).
    import yaml

    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps(tiny_model_config("llama", hidden_size=48)))
    config["model"]["config"] = str(other)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "does not fit the base model" in err and "Engine(model=...)" in err and "Traceback" not in err


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 400}, r"not 'gpt2'"),
        ({**tiny_model_config("llama", vocab_size=400), "rope_parameters": LLAMA3_ROPE}, r"rope scaling \(llama3\)"),
        ({**tiny_model_config("qwen2", vocab_size=400), "model_type": "mistral", "sliding_window": 16},
         r"sliding-window attention \(window 16\)"),
    ],
    ids=["gpt2", "llama3-rope", "sliding-window"],
)
def test_gguf_refuses_what_it_cannot_write(config: dict[str, Any], message: str, bpe_tokenizer_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.gguf_export import GGUFExportError, check_supported

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    with pytest.raises(GGUFExportError, match=message + r".*convert_hf_to_gguf"):
        check_supported(model, AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/missing", "--out", "{tmp}/o"], "does not exist"),
        (["{tmp}", "--out", "{tmp}/o"], "neither a checkpoint"),
        (["{tmp}"], "nothing to write"),
    ],
)
def test_export_mistakes_get_one_clear_message(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["export", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_export_refuses_a_non_empty_out_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_plugins.export import ExportError, save_checkpoint_dir

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="--overwrite"):
        save_checkpoint_dir(None, None, tmp_path / "out", overwrite=False)  # type: ignore[arg-type]
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_export_refuses_a_non_empty_out_folder_before_loading_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_plugins import export as export_module

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(export_module, "load_policy", no_loading)
    monkeypatch.setattr(export_module, "find_checkpoint", lambda source: tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(export_module.ExportError, match="exists and is not empty"):
        export_module.export(tmp_path / "run", tmp_path / "out")
