"""compile_layers: the decoder layers' compiled forwards give the eager results, compile once,
and are active only in the training and log-prob passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_plugins.compiled_layers import CompiledLayers, decoder_layers
from grpo_plugins.config import GRPOConfig
from grpo_plugins.engine import Engine
from grpo_plugins.logprobs import completion_logps
from grpo_plugins.metrics import read_metrics
from grpo_plugins.models import enable_gradient_checkpointing, load_model
from grpo_plugins.testing import tiny_model_config

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _model(arch: str, layers: int = 3) -> Any:
    cfg = tiny_model_config(arch, num_hidden_layers=layers)
    model_type = cfg.pop("model_type", arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    enable_gradient_checkpointing(model)
    return model.train()


def _logps_and_grads(model: Any, ids: torch.Tensor, att: torch.Tensor, t: int, layers: CompiledLayers | None) -> tuple:
    model.zero_grad(set_to_none=True)
    chunk_fn = layers.chunk_logps if layers is not None else None
    with layers.active() if layers is not None else torch.enable_grad():
        logps, entropy = completion_logps(
            model, ids, att, t, temperature=0.7, chunk_size=5, with_entropy=True, chunk_fn=chunk_fn
        )
        (logps * torch.linspace(-1, 1, t)).sum().backward()
    return logps.detach(), entropy, {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_layers_equal_eager_and_compile_once(arch: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    model = _model(arch)
    layers = CompiledLayers.for_model(model, backend="aot_eager")
    assert layers is not None and len(layers.layers) == 3
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    for rows, length, t in [(4, 12, 5), (3, 17, 9), (2, 9, 4)]:  # rows and lengths change: no recompilation
        ids = torch.randint(3, vocab, (rows, length), generator=gen)
        att = torch.ones(rows, length, dtype=torch.long)
        att[0, :3] = 0  # left padding
        eager, eager_entropy, eager_grads = _logps_and_grads(model, ids, att, t, None)
        compiled, compiled_entropy, compiled_grads = _logps_and_grads(model, ids, att, t, layers)
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(compiled_entropy, eager_entropy, rtol=1e-6, atol=1e-6)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        assert any(g.abs().sum() > 0 for g in eager_grads.values())
    # One graph for every layer and every shape, one for the log-softmax chunk (whose last
    # chunk is shorter): anything more is a recompilation.
    assert counters["stats"]["unique_graphs"] == 2
    # Outside the block the layers are the model's own, eager ones again.
    assert all("forward" not in layer.__dict__ for layer in layers.layers)


def test_a_lora_model_without_checkpointing_compiles_its_layer_once() -> None:
    """Frozen embeddings hand the first layer an input that needs no grad, and every later layer
    one that does; inside the block the embeddings' output requires grad, so one graph serves
    every layer, with the eager gradients. Outside the block nothing changes."""
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_model_config("llama", num_hidden_layers=3)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg))
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).train()
    layers = CompiledLayers.for_model(model, backend="aot_eager")
    assert layers is not None
    ids = torch.randint(3, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(2))
    att = torch.ones_like(ids)
    eager, _, eager_grads = _logps_and_grads(model, ids, att, 4, None)
    compiled, _, compiled_grads = _logps_and_grads(model, ids, att, 4, layers)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert {n for n, g in eager_grads.items() if g is not None} == {n for n, g in compiled_grads.items() if g is not None}
    for name, grad in eager_grads.items():
        if grad is not None:
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 2  # the layer, the log-softmax chunk
    embeddings = model.get_input_embeddings()
    assert not embeddings._forward_hooks  # the hook lives only inside the block
    with torch.enable_grad():
        assert not embeddings(ids).requires_grad


def test_no_grad_passes_compile_one_layer_graph_for_every_layer() -> None:
    """Gradient checkpointing installs transformers' hook that makes the embeddings' output
    require grad, under no_grad too, where no later layer's input does; inside the block the
    first layer gets a detached input, so the log-prob passes (no_grad) compile one layer graph,
    with the eager values."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("llama")
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(3))
    att = torch.ones_like(ids)
    with torch.no_grad():
        assert model.get_input_embeddings()(ids).requires_grad  # the premise: transformers' hook
        eager, _ = completion_logps(model, ids, att, 4, chunk_size=5)
    layers = CompiledLayers.for_model(model, backend="aot_eager")
    assert layers is not None
    with torch.no_grad(), layers.active():
        compiled, _ = completion_logps(model, ids, att, 4, chunk_size=5, chunk_fn=layers.chunk_logps)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2  # the layer, the log-softmax chunk


def test_compiled_forward_is_installed_only_inside_the_block() -> None:
    model = _model("llama", layers=2)
    layers = CompiledLayers(decoder_layers(model), backend="aot_eager")
    calls: list[bool] = []
    for layer in layers.layers:
        layer.register_forward_pre_hook(lambda m, a: calls.append("forward" in m.__dict__))
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        model(ids)
        with layers.active():
            model(ids)
        model(ids)
    assert calls == [False, False, True, True, False, False]


def test_decoder_layers_of_a_model_without_a_layer_list_is_none() -> None:
    class NoDecoder(torch.nn.Module):
        pass

    assert decoder_layers(NoDecoder()) is None
    assert CompiledLayers.for_model(NoDecoder()) is None


def test_compile_layers_config_default_is_auto() -> None:
    assert GRPOConfig.model_validate({}).compile_layers is None
    assert GRPOConfig.model_validate({"compile_layers": False}).compile_layers is False


def _train(tiny_model: dict, tmp_path: Path, compile_layers: bool, settings: dict[str, Any]) -> tuple[Any, list, Any]:
    model, tok = load_model(tiny_model, dtype="float32", seed=0, gradient_checkpointing=True, lora=settings.get("lora"))
    out = tmp_path / f"out-{compile_layers}"
    cfg = {
        "model": tiny_model,
        "task": None,
        "output_dir": str(out),
        "max_steps": 2,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,  # the second step is off-policy: the old-logp pass runs compiled too
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-3,
        "report_to": ["jsonl"],
        "seed": 0,
        "gradient_checkpointing": True,
        "compile_layers": compile_layers,
        **settings,
    }
    engine = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    return model, read_metrics(out), engine.compiled_layers


@pytest.mark.parametrize(
    "settings",
    [{}, {"train_chunk_rows": 3, "beta": 0.1}, {"lora": {"r": 4}, "beta": 0.1}],
    ids=["whole", "chunks+ref", "lora+ref"],
)
def test_engine_with_compiled_layers_trains_like_eager(tiny_model: dict, tmp_path: Path, settings: dict) -> None:
    torch._dynamo.reset()
    eager, eager_log, none = _train(tiny_model, tmp_path, False, settings)
    compiled, compiled_log, layers = _train(tiny_model, tmp_path, True, settings)
    assert none is None and layers is not None
    worst = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(eager.parameters(), compiled.parameters(), strict=True)
    )
    assert worst <= 1e-6, worst
    for e, c in zip(eager_log, compiled_log, strict=True):
        for key in ("loss", "grad_norm", "entropy", *(("kl",) if "beta" in settings else ())):
            assert c[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), key
    assert any(r["grad_norm"] > 0 for r in eager_log)


def test_a_compilation_failure_is_one_clear_error(tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_plugins import compiled_layers
    from grpo_plugins.errors import GRPOPluginsError

    def broken_backend(graph: Any, example_inputs: Any) -> Any:
        raise RuntimeError("Cannot find a working triton installation")

    original = compiled_layers.CompiledLayers.__init__

    def init(self: Any, layers: Any, backend: Any = "inductor", **kwargs: Any) -> None:
        original(self, layers, backend=broken_backend, **kwargs)

    monkeypatch.setattr(compiled_layers.CompiledLayers, "__init__", init)
    torch._dynamo.reset()
    with pytest.raises(GRPOPluginsError, match="compile_layers: torch.compile failed .*triton.*compile_layers: false"):
        _train(tiny_model, tmp_path, True, {})


def test_default_compiles_on_cuda_for_full_and_lora_but_not_over_a_quantized_base() -> None:
    from peft import LoraConfig, get_peft_model

    from grpo_plugins.compiled_layers import compiled_layers_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # nothing is compiled until first called
    full = _model("llama", layers=2)
    lora = get_peft_model(_model("llama", layers=2), LoraConfig(r=4, target_modules="all-linear"))
    assert compiled_layers_for(full, None, cuda) is not None
    assert compiled_layers_for(lora, None, cuda) is not None  # the LoRA NaN was cuDNN attention's (attention.py)
    assert compiled_layers_for(lora, None, cuda, quantized=True) is None
    assert compiled_layers_for(lora, True, cuda, quantized=True) is not None  # asked for explicitly
    assert compiled_layers_for(full, None, cpu) is None
    assert compiled_layers_for(full, False, cuda) is None
