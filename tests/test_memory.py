"""Memory settings: offloaded activation checkpointing (same loss and gradients as plain), a LoRA
run's frozen base (no gradients, no optimizer state, no float32 copies), and QLoRA
(``load_in_4bit`` / ``load_in_8bit`` with bitsandbytes, which runs on CPUs too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.config import GRPOConfig, load_config
from grpo_plugins.engine import Engine
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.logprobs import completion_logps
from grpo_plugins.models import load_model
from grpo_plugins.offload import OffloadActivations

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]


@pytest.fixture(autouse=True)
def _eager() -> Iterator[None]:
    """bitsandbytes' CPU backend torch.compiles its dequantisation once per weight shape (13 s
    here); nothing in these tests needs compiling, so compiled functions run eagerly."""
    with torch.compiler.set_stance("force_eager"):
        yield


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two left-padded rows: 3 prompt columns, then 5 completion tokens."""
    ids = torch.tensor([[0, 7, 8, 20, 21, 22, 23, 24], [9, 10, 11, 30, 31, 32, 33, 34]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    return ids, mask, 5


#: Offloading moves device tensors to pinned host memory: checked on a GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _loss_and_grads(
    tiny_model: dict, lora: dict | None, offload: bool, device: str = "cpu"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model, _ = load_model(
        tiny_model, dtype="float32", seed=0, lora=lora, gradient_checkpointing=True, activation_offload=offload,
        device=device,
    )
    model.train()
    ids, mask, T = (x.to(device) if isinstance(x, torch.Tensor) else x for x in _batch())
    logps, _ = completion_logps(model, ids, mask, T)  # (2, 5)
    weights = torch.linspace(-1.0, 1.0, 10, device=device).reshape(2, 5)
    loss = (logps * weights).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora", [None, {"r": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_offloaded_checkpointing_gives_the_same_loss_and_gradients(tiny_model: dict, lora: dict | None, device: str) -> None:
    plain_loss, plain_grads = _loss_and_grads(tiny_model, lora, offload=False, device=device)
    before = OffloadActivations.packed
    offloaded_loss, offloaded_grads = _loss_and_grads(tiny_model, lora, offload=True, device=device)
    # One hidden-state input per checkpointed layer (2 layers) went through the CPU copy; the
    # shared mask and rotary tables (no grad) were not copied.
    assert OffloadActivations.packed - before == 2
    assert offloaded_loss.item() == plain_loss.item()
    assert plain_grads.keys() == offloaded_grads.keys()
    assert any(g.abs().sum() > 0 for g in plain_grads.values())
    for name, grad in plain_grads.items():
        assert torch.equal(offloaded_grads[name], grad), name


def test_activation_offload_needs_gradient_checkpointing() -> None:
    with pytest.raises(GRPOPluginsError, match="activation_offload.*gradient_checkpointing: true"):
        load_config({"activation_offload": True})
    config = load_config({"activation_offload": True, "gradient_checkpointing": True})
    assert config.activation_offload
    # accepted under model: too, as dtype and lora are
    config = load_config({"model": {"name_or_path": "x", "gradient_checkpointing": True, "activation_offload": True}})
    assert config.activation_offload


# -- LoRA: the frozen base ------------------------------------------------------------------------


def _lora_engine(tiny_model: dict, tmp_path: Path, **settings: Any) -> Engine:
    config = {
        "model": tiny_model,
        "task": None,
        "lora": {"r": 4, "lora_alpha": 8},
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 5,
        "learning_rate": 1e-2,
        "report_to": [],
        "seed": 0,
        **settings,
    }
    return Engine(config, rewards=[char_sum], dataset=PROMPTS)


def test_lora_base_holds_no_gradients_optimizer_state_or_float32_copies(tiny_model: dict, tmp_path: Path) -> None:
    engine = _lora_engine(tiny_model, tmp_path, dtype="bfloat16", gradient_checkpointing=True, beta=0.1)
    engine.train()
    model = engine.unwrapped
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert lora and base
    assert all(p.requires_grad and p.dtype == torch.float32 for p in lora.values())
    assert all(not p.requires_grad and p.grad is None for p in base.values())
    assert all(p.dtype == torch.bfloat16 for p in base.values())  # never upcast
    assert engine.master is None  # float32 adapters need no master copies
    stepped = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in lora.values()}
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(lora)
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(p.numel() for p in lora.values())


# -- QLoRA ------------------------------------------------------------------------------------------


def test_quantisation_settings_are_validated() -> None:
    with pytest.raises(GRPOPluginsError, match="load_in_4bit.*lora"):
        load_config({"load_in_4bit": True})
    with pytest.raises(GRPOPluginsError, match="mutually exclusive"):
        load_config({"load_in_4bit": True, "load_in_8bit": True, "lora": {"r": 8}})
    assert load_config({"load_in_4bit": True, "lora": {"r": 8}}).quantization_bits == 4
    assert load_config({"load_in_8bit": True, "lora": {"r": 8}}).quantization_bits == 8
    assert load_config({"model": {"name_or_path": "x", "load_in_4bit": True}, "lora": {"r": 8}}).quantization_bits == 4
    assert GRPOConfig().quantization_bits is None
    with pytest.raises(GRPOPluginsError, match="vllm generator cannot take weights from a bitsandbytes"):
        load_config({"load_in_4bit": True, "lora": {"r": 8}, "fast_inference": True})


def test_validate_names_the_missing_bitsandbytes(tiny_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from grpo_plugins.validation import check_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    check = check_config({"model": tiny_model, "load_in_4bit": True, "lora": {"r": 8}})
    assert [path for path, _ in check.problems] == ["load_in_4bit"]
    assert "pip install 'grpo-plugins[qlora]'" in check.problems[0][1]
    monkeypatch.undo()
    assert check_config({"model": tiny_model, "load_in_4bit": True, "lora": {"r": 8}}).ok


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_model_replaces_the_linear_layers_but_not_the_head(tiny_model: dict, bits: int) -> None:
    import bitsandbytes as bnb

    from grpo_plugins.quantization import is_quantized, quantize_model, quantized_layer_count

    plain, _ = load_model(tiny_model, dtype="float32", seed=0)
    quantized, _ = load_model(tiny_model, dtype="float32", seed=0, quantization_bits=bits)
    assert not is_quantized(plain)
    assert quantized_layer_count(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(quantized.lm_head) is torch.nn.Linear
    kind = bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt
    assert isinstance(quantized.model.layers[0].mlp.down_proj, kind)
    assert getattr(quantized, f"is_loaded_in_{bits}bit")
    assert not any(p.requires_grad for p in quantized.parameters())
    assert quantize_model(quantized, bits, torch.float32, "cpu") is quantized  # already quantised: kept
    # The quantised model computes nearly the same function (NF4 / int8 rounding of random weights).
    ids, mask, T = _batch()
    with torch.no_grad():
        a, _ = completion_logps(plain.eval(), ids, mask, T)
        b, _ = completion_logps(quantized.eval(), ids, mask, T)
    assert (a - b).abs().max() < 0.2
    assert (a - b).abs().max() > 0  # but it is quantised


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_the_adapter_and_leaves_the_quantised_base(tiny_model: dict, tmp_path: Path, bits: int) -> None:
    from peft.tuners.lora import bnb as lora_bnb

    engine = _lora_engine(
        tiny_model, tmp_path, **{f"load_in_{bits}bit": True}, beta=0.1, gradient_checkpointing=True,
        activation_offload=True, generator="static",
    )
    engine._setup()
    model = engine.unwrapped
    kind = lora_bnb.Linear4bit if bits == 4 else lora_bnb.Linear8bitLt
    wrapped = [m for m in model.modules() if isinstance(m, kind)]
    assert len(wrapped) == 14  # peft put its bitsandbytes LoRA layers on every quantised linear
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    result = engine._run(None)
    engine._teardown()
    assert result.global_step == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)
    assert any(r["kl"] > 0 for r in result.history)  # the reference (adapter disabled) differs from the policy
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base_before.items())
    assert any(not torch.equal(after[n], p) for n, p in lora_before.items())


def test_a_given_model_is_quantised_as_the_config_says(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.quantization import quantized_layer_count

    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    config = {
        "task": None, "lora": {"r": 4}, "load_in_4bit": True, "output_dir": str(tmp_path), "max_steps": 1,
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4, "report_to": [],
    }
    engine = Engine(config, model=model, tokenizer=tokenizer, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    assert quantized_layer_count(engine.unwrapped) == 14


def test_quantised_base_decodes_uncompiled_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    from grpo_plugins.generators.static_cache import StaticCacheGenerator, decode_flags

    params = StaticCacheGenerator.Params()
    assert decode_flags(params, on_cuda=True, quantized=False) == (True, True)
    with caplog.at_level("INFO", logger="grpo_plugins.generators.static_cache"):
        assert decode_flags(params, on_cuda=True, quantized=True) == (False, True)
    assert "quantised" in caplog.text and "compile param" in caplog.text
    explicit = StaticCacheGenerator.Params(compile=True)
    assert decode_flags(explicit, on_cuda=True, quantized=True) == (True, True)
    assert decode_flags(params, on_cuda=False, quantized=True) == (False, False)


def test_static_generator_samples_from_a_quantised_model(tiny_model: dict) -> None:
    """The decode loop runs the quantised layers (and the adapter) exactly as a forward does."""
    from grpo_plugins.generators.static_decode import StaticDecoder
    from grpo_plugins.kinds import SamplingSettings

    model, _ = load_model(tiny_model, dtype="float32", seed=0, quantization_bits=4, lora={"r": 4})
    model.eval()
    prompts = [[1, 5, 6, 7], [1, 9]]
    torch.manual_seed(0)
    ids, mask, _, logps = StaticDecoder(model, SamplingSettings(max_completion_length=6), [], 0, prompt_multiple=4).generate(prompts)
    for row, prompt in enumerate(prompts):
        n = int(mask[row].sum())
        full = torch.tensor([prompt + ids[row, :n].tolist()])
        with torch.no_grad():
            expected, _ = completion_logps(model, full, torch.ones_like(full), n)
        torch.testing.assert_close(logps[row, :n], expected[0], atol=1e-4, rtol=1e-4)
