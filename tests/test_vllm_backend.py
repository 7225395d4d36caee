"""The ``vllm`` generator's own logic against a small fake of vLLM's offline API (vLLM itself
cannot be installed here): parameter mapping, prompt grouping, output conversion, weight sync."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from grpo_plugins.generators import GeneratorUnavailableError
from grpo_plugins.generators.vllm_backend import (
    VLLMGenerator,
    VLLMGeneratorParams,
    _group_repeats,
    policy_weights,
)
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model

EOS, PAD = 2, 0


# -- the fake ---------------------------------------------------------------------------------------


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str = "length"


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.n = kwargs.get("n", 1)


@dataclass
class EngineModel:
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    load_calls: int = 0

    def load_weights(self, weights) -> set[str]:
        self.load_calls += 1
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


class FakeLLM:
    """Records its construction, requests and weight loads; completions come from ``script``,
    a list consumed in order: (token_ids, finish_reason)."""

    instances: list[FakeLLM] = []
    script: list[tuple[list[int], str]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.engine_model = EngineModel()
        self.requests: list[tuple[list[dict], list[SamplingParams]]] = []
        self.prefix_resets = 0
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.requests.append((prompts, sampling_params))
        results = []
        for prompt, params in zip(prompts, sampling_params):
            outs = []
            for _ in range(params.n):
                tokens, reason = FakeLLM.script.pop(0)
                logprobs = [{t: Logprob(-0.1 * (i + 1)), 99: Logprob(-9.0)} for i, t in enumerate(tokens)]
                outs.append(CompletionOutput(list(tokens), logprobs, reason))
            results.append(RequestOutput(outs))
        return results

    def apply_model(self, func):
        return [func(self.engine_model)]

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True


class FakeLLMv0(FakeLLM):
    """An older vLLM: no apply_model; the model sits behind llm_engine...model_runner."""

    apply_model = None  # type: ignore[assignment]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        runner = types.SimpleNamespace(model=self.engine_model)
        worker = types.SimpleNamespace(model_runner=runner)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))


def _fake_vllm(llm_class: type = FakeLLM) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = llm_class
    module.SamplingParams = SamplingParams
    return module


@pytest.fixture()
def fake_vllm(monkeypatch) -> types.ModuleType:
    FakeLLM.instances, FakeLLM.script = [], []
    module = _fake_vllm()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def _setup(model_spec, params: dict | None = None, **sampling) -> tuple[VLLMGenerator, Any, Any]:
    model, tokenizer = load_model(model_spec, seed=0, **({"lora": sampling.pop("lora")} if "lora" in sampling else {}))
    gen = VLLMGenerator(VLLMGeneratorParams(**(params or {})))
    gen.setup(model, tokenizer, SamplingSettings(**{"max_completion_length": 6, "seed": 11, **sampling}))
    return gen, model, tokenizer


# -- tests ------------------------------------------------------------------------------------------


def test_sampling_settings_map_to_sampling_params(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model, temperature=0.7, top_p=0.9, top_k=None, min_p=None, repetition_penalty=1.2)
    p = gen.sampling_params(4, 0).kwargs
    assert p == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.2,
        "max_tokens": 6, "logprobs": 0, "seed": p["seed"],
    }
    gen.sampling = SamplingSettings(top_k=5, min_p=0.05, seed=None)
    q = gen.sampling_params(1, 0).kwargs
    assert q["top_k"] == 5 and q["min_p"] == 0.05 and q["seed"] is None


def test_groups_of_identical_prompts_become_one_request_with_n_samples(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    FakeLLM.script = [([5, EOS], "stop")] * 4
    out = gen.generate([[7, 8], [7, 8], [9], [9]])
    prompts, params = FakeLLM.instances[-1].requests[-1]
    assert prompts == [{"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [9]}]
    assert [p.n for p in params] == [2, 2]
    assert len({p.kwargs["seed"] for p in params}) == 2  # each request its own stream
    assert out.completion_ids.shape == (4, 2)

    FakeLLM.script = [([5, EOS], "stop")] * 3
    gen.generate([[7], [9], [7]])
    prompts, params = FakeLLM.instances[-1].requests[-1]
    assert len(prompts) == 3 and [p.n for p in params] == [1, 1, 1]
    seeds_first_call = {p.kwargs["seed"] for p in FakeLLM.instances[-1].requests[0][1]}
    assert seeds_first_call.isdisjoint({p.kwargs["seed"] for p in params})  # calls differ too


def test_group_repeats() -> None:
    assert _group_repeats([[1], [1], [2], [2]]) == ([[1], [2]], 2)
    assert _group_repeats([[1], [1], [2]]) == ([[1], [1], [2]], 1)
    assert _group_repeats([[1], [2]]) == ([[1], [2]], 1)


def test_outputs_become_a_generation_output(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    FakeLLM.script = [
        ([5, EOS, 6], "stop"),  # tokens after EOS are dropped; EOS is kept and masked in
        ([5, 6, 7, 8, 9, 10], "length"),  # hit max_completion_length: truncated
        ([5, 6], "stop"),  # stopped by a stop string (no EOS): complete, not truncated
    ]
    out = gen.generate([[7], [8], [9]])
    assert out.completion_ids.tolist() == [[5, EOS, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10], [5, 6, PAD, PAD, PAD, PAD]]
    assert out.completion_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]]
    assert out.is_truncated.tolist() == [False, True, False]
    expected = torch.tensor(
        [[-0.1, -0.2, 0, 0, 0, 0], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], [-0.1, -0.2, 0, 0, 0, 0]]
    )
    torch.testing.assert_close(out.sampling_logps, expected)
    assert out.completion_ids.dtype == torch.long and out.is_truncated.dtype == torch.bool


def test_missing_logprobs_give_none(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    out = gen.to_generation_output([CompletionOutput([5, EOS], None, "stop")])
    assert out.sampling_logps is None and out.completion_mask.tolist() == [[1, 1]]


def test_engine_is_built_from_the_policy_and_synced_at_setup(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"gpu_memory_utilization": 0.5, "engine_kwargs": {"max_num_seqs": 64}})
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["dtype"] == "float32" and llm.kwargs["seed"] == 11
    assert llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.kwargs["max_num_seqs"] == 64
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    # A random initialisation has no directory: it is written once for the engine to read.
    from pathlib import Path

    source = Path(llm.kwargs["model"])
    assert (source / "config.json").is_file() and llm.kwargs["tokenizer"] == str(source)
    assert llm.engine_model.load_calls == 1 and llm.prefix_resets == 1
    state = model.state_dict()
    assert llm.engine_model.loaded.keys() == state.keys()


def test_a_local_checkpoint_is_handed_to_the_engine_as_is(fake_vllm, tiny_model: dict, tmp_path) -> None:
    model, tokenizer = load_model(tiny_model)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    gen, _, _ = _setup(str(tmp_path / "ckpt"))
    assert FakeLLM.instances[-1].kwargs["model"] == str(tmp_path / "ckpt")


def test_weight_sync_loads_merged_lora_weights_under_base_names(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, lora={"r": 2, "lora_alpha": 4})
    with torch.no_grad():  # a "training step": the adapters move away from zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    before = {n: t.clone() for n, t in model.get_base_model().state_dict().items()}
    gen.on_weights_updated(model)
    llm = FakeLLM.instances[-1]
    loaded = llm.engine_model.loaded
    assert llm.engine_model.load_calls == 2 and llm.prefix_resets == 2
    assert not any("lora_" in n or "base_layer" in n for n in loaded)
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    torch.testing.assert_close(loaded[q], layer.base_layer.weight + delta)
    after = model.get_base_model().state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the policy itself is untouched


def test_weight_sync_through_the_older_engine_path(monkeypatch, tiny_model: dict) -> None:
    FakeLLM.instances, FakeLLM.script = [], []
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(FakeLLMv0))
    gen, model, _ = _setup(tiny_model)
    gen.on_weights_updated(model)
    assert FakeLLM.instances[-1].engine_model.load_calls == 2


def test_sync_weights_off_loads_nothing(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"sync_weights": False})
    gen.on_weights_updated(model)
    assert FakeLLM.instances[-1].engine_model.load_calls == 0


def test_policy_weights_of_a_plain_model_are_its_state_dict(tiny_model: dict) -> None:
    model, _ = load_model(tiny_model)
    names = [n for n, _ in policy_weights(model)]
    assert names == list(model.state_dict())


def test_without_vllm_setup_says_so(monkeypatch, tiny_model: dict) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    model, tokenizer = load_model(tiny_model)
    with pytest.raises(GeneratorUnavailableError, match="needs vLLM.*fast_inference: false"):
        VLLMGenerator().setup(model, tokenizer, SamplingSettings())


def test_it_asks_for_the_rollout_correction() -> None:
    assert VLLMGenerator.samples_from_policy is False
