"""The ``vllm`` generator's own logic against a small fake of vLLM 0.26's offline API (vLLM
cannot be installed on these CPU machines): parameter mapping, per-sample seeds, prompt grouping,
output conversion, the engine's starting checkpoint, weight sync, sleep mode, environment."""

from __future__ import annotations

import json
import os
import random
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from grpo_plugins.generators import GeneratorUnavailableError
from grpo_plugins.generators.vllm_backend import (
    SEED_LIMIT,
    VLLMGenerator,
    VLLMGeneratorParams,
    group_repeats,
    policy_weights,
)
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.testing import tiny_model_spec

EOS, PAD = 2, 0
INT64_MAX = 2**63 - 1


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
    """Validates as vLLM 0.26 does for the fields used here."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("top_k", 0) < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {kwargs['top_k']}.")
        if kwargs.get("seed") == -1:
            kwargs["seed"] = None
        self.kwargs = kwargs
        self.n = kwargs.get("n", 1)
        self.seed = kwargs.get("seed")


def _check_names(names: Any) -> None:
    """vLLM's loader (AutoWeightsLoader) knows no parameter named after peft's wrappers."""
    for name in names:
        if "base_layer" in name or "lora_" in name:
            raise ValueError(f"There is no module or parameter named {name!r} in the model")


@dataclass
class EngineModel:
    llm: FakeLLM
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    load_calls: int = 0
    last_load: dict[str, torch.Tensor] = field(default_factory=dict)  # what the last load wrote

    def load_weights(self, weights) -> set[str]:
        if self.llm.asleep.get("weights"):
            raise RuntimeError("weights loaded into the engine's released memory")
        self.load_calls += 1
        self.llm.events.append(("load",))
        for name, tensor in weights:
            _check_names([name])
            self.loaded[name] = tensor.clone()
        self.last_load = dict(self.loaded)
        return set(self.loaded)


class GPUModelRunner:
    """vLLM >= 0.16's runner: reload_weights takes an iterator."""

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None: ...


class OldGPUModelRunner:
    """An older runner: reload_weights only re-reads the checkpoint from disk."""

    def reload_weights(self) -> None: ...


class FakeLLM:
    """Records its construction, requests, weight loads and sleep calls (``events``);
    completions come from ``script``, a list consumed in order: (token_ids, finish_reason).
    Sample j of a request gets the seed ``seed + j``, stored in an int64 array as vLLM does."""

    instances: list[FakeLLM] = []
    script: list[tuple[list[int], str]] = []
    default: tuple[list[int], str] | None = None  # the completion once the script is used up

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        seed = kwargs.get("seed", 0)  # vLLM's set_random_seed: np.random.seed needs < 2**32
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        source = Path(kwargs["model"])
        if not (source / "config.json").is_file():
            raise OSError(f"{source} has no config.json")
        self.config = json.loads((source / "config.json").read_text())
        if not self.config.get("architectures"):
            raise ValueError("No model architectures are specified")
        self.checkpoint: dict[str, torch.Tensor] = {}
        for file in source.glob("*.safetensors"):
            from safetensors.torch import load_file

            self.checkpoint.update(load_file(file))
        _check_names(self.checkpoint)
        self.engine_model = EngineModel(self, dict(self.checkpoint))
        self.requests: list[tuple[list[dict], list[SamplingParams]]] = []
        self.sample_seeds: list[list[int | None]] = []  # one list per generate call
        self.events: list[tuple[Any, ...]] = []
        self.rpc_calls: list[tuple[str, dict]] = []
        self.asleep: dict[str, bool] = {}
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        if any(self.asleep.values()):
            raise RuntimeError("generate on a sleeping engine")
        self.events.append(("generate",))
        self.requests.append((prompts, sampling_params))
        seeds = np.zeros(sum(p.n for p in sampling_params), dtype=np.int64)  # OverflowError past int64
        call_seeds: list[int | None] = []
        results = []
        for params in sampling_params:
            outs = []
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + j
                if seed is not None:
                    seeds[len(call_seeds)] = seed
                call_seeds.append(seed)
                tokens, reason = FakeLLM.script.pop(0) if FakeLLM.script or not FakeLLM.default else FakeLLM.default
                logprobs = [{t: Logprob(-0.1 * (i + 1)), 99: Logprob(-9.0)} for i, t in enumerate(tokens)]
                outs.append(CompletionOutput(list(tokens), logprobs, reason))
            results.append(RequestOutput(outs))
        self.sample_seeds.append(call_seeds)
        return results

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc_calls.append((method, dict(kwargs or {})))
        if method != "reload_weights":
            raise AttributeError(method)
        return [self.engine_model.load_weights(kwargs["weights_iterator"])]

    def apply_model(self, func):
        self.events.append(("apply_model",))
        return [func(self.engine_model)]

    def reset_prefix_cache(self) -> bool:
        self.events.append(("reset_prefix_cache",))
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        assert self.kwargs.get("enable_sleep_mode"), "sleep needs LLM(enable_sleep_mode=True)"
        self.events.append(("sleep", level))
        self.asleep = {"weights": True, "kv_cache": True}
        if level == 2:  # weights discarded
            self.engine_model.loaded = {n: torch.full_like(t, float("nan")) for n, t in self.engine_model.loaded.items()}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(("wake_up", tags))
        for tag in tags or ["weights", "kv_cache"]:
            self.asleep[tag] = False


def _fake_vllm(runner: type = GPUModelRunner) -> dict[str, types.ModuleType]:
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = SamplingParams
    gpu_model_runner = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    gpu_model_runner.GPUModelRunner = runner
    return {
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.worker": types.ModuleType("vllm.v1.worker"),
        "vllm.v1.worker.gpu_model_runner": gpu_model_runner,
    }


@pytest.fixture()
def vllm_env(monkeypatch) -> None:
    """The environment variables the backend sets, restored after the test."""
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture()
def fake_vllm(monkeypatch, vllm_env) -> types.ModuleType:
    FakeLLM.instances, FakeLLM.script, FakeLLM.default = [], [], None
    modules = _fake_vllm()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["vllm"]


def _setup(model_spec, params: dict | None = None, **sampling) -> tuple[VLLMGenerator, Any, Any]:
    model, tokenizer = load_model(model_spec, seed=0, **({"lora": sampling.pop("lora")} if "lora" in sampling else {}))
    gen = VLLMGenerator(VLLMGeneratorParams(**(params or {})))
    gen.setup(model, tokenizer, SamplingSettings(**{"max_completion_length": 6, "seed": 11, **sampling}))
    return gen, model, tokenizer


def _move_adapters(model) -> None:
    """A "training step": the LoRA adapters move away from zero."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)


def _merged_q_proj(model) -> torch.Tensor:
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    return layer.base_layer.weight + delta


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


# -- sampling parameters and seeds ------------------------------------------------------------------


def test_sampling_settings_map_to_sampling_params(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model, temperature=0.7, top_p=0.9, top_k=None, min_p=None, repetition_penalty=1.2)
    p = gen.sampling_params(4, 123).kwargs
    assert p == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.2,
        "max_tokens": 6, "logprobs": 0, "seed": 123, "detokenize": False,
    }
    gen.sampling = SamplingSettings(top_k=5, min_p=0.05, seed=None)
    q = gen.sampling_params(1, None).kwargs
    assert q["top_k"] == 5 and q["min_p"] == 0.05 and q["seed"] is None


def test_generation_kwargs_reach_sampling_params(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    gen.sampling = SamplingSettings(extra={"presence_penalty": 0.3, "stop": ["\n\n"]})
    p = gen.sampling_params(2, None).kwargs
    assert p["presence_penalty"] == 0.3 and p["stop"] == ["\n\n"]
    assert p["detokenize"] is True  # stop strings are matched on the text
    gen.sampling = SamplingSettings(extra={"detokenize": True})
    assert gen.sampling_params(2, None).kwargs["detokenize"] is True  # the user's choice wins
    assert type(gen).accepts_generation_kwargs


def test_top_k_off_is_vllms_neutral_zero(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model, top_k=None)
    assert gen.sampling_params(2, None).kwargs["top_k"] == 0
    gen.sampling = SamplingSettings(top_k=0)
    assert gen.sampling_params(2, None).kwargs["top_k"] == 0


def test_every_sample_of_a_call_gets_its_own_seed(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    llm = FakeLLM.instances[-1]
    FakeLLM.script = [([5, EOS], "stop")] * 24
    gen.generate([[7]] * 4 + [[8]] * 4 + [[9]] * 4)  # 3 groups of 4: seeds seed+0..seed+3 each
    gen.generate([[7]] * 4 + [[8]] * 4 + [[9]] * 4)
    first, second = llm.sample_seeds
    assert len(set(first)) == 12 and len(set(second)) == 12  # no two samples share a stream
    assert set(first).isdisjoint(second)  # nor do two calls


def test_seeds_fit_vllms_int64_seed_array_for_any_config_seed(fake_vllm, tiny_model: dict) -> None:
    for config_seed in (10**9, 2**62, 2**70):
        gen, _, _ = _setup(tiny_model, seed=config_seed)
        FakeLLM.script = [([5, EOS], "stop")] * 8
        gen.generate([[7]] * 4 + [[8]] * 4)  # the fake raises OverflowError past int64
        seeds = FakeLLM.instances[-1].sample_seeds[-1]
        assert all(0 <= s <= INT64_MAX for s in seeds)


def test_seed_base_leaves_room_for_every_sample() -> None:
    gen = VLLMGenerator()
    gen.sampling = SamplingSettings(seed=3)
    for calls in range(50):
        gen.calls = calls
        assert 0 <= gen.seed_base(1000) <= SEED_LIMIT - 1000


def test_seeds_are_reproducible_and_follow_the_config_seed(fake_vllm, tiny_model: dict) -> None:
    def seeds(config_seed: int) -> list[int | None]:
        gen, _, _ = _setup(tiny_model, seed=config_seed)
        FakeLLM.script = [([5, EOS], "stop")] * 2
        gen.generate([[7], [7]])
        return FakeLLM.instances[-1].sample_seeds[-1]

    assert seeds(1) == seeds(1) and seeds(1) != seeds(2)


def test_without_a_seed_vllm_draws_its_own(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model, seed=None)
    FakeLLM.script = [([5, EOS], "stop")] * 2
    gen.generate([[7], [7]])
    assert FakeLLM.instances[-1].sample_seeds[-1] == [None, None]


def test_the_call_counter_survives_a_resume(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    FakeLLM.script = [([5, EOS], "stop")] * 4
    gen.generate([[7], [7]])
    state = gen.state_dict()
    gen.generate([[7], [7]])
    resumed, _, _ = _setup(tiny_model)
    resumed.load_state_dict(state)
    FakeLLM.script = [([5, EOS], "stop")] * 2
    resumed.generate([[7], [7]])
    assert FakeLLM.instances[-1].sample_seeds[-1] == FakeLLM.instances[-2].sample_seeds[-1]


# -- requests and outputs -------------------------------------------------------------------------


def test_groups_of_identical_prompts_become_one_request_with_n_samples(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    FakeLLM.script = [([5, EOS], "stop")] * 4
    out = gen.generate([[7, 8], [7, 8], [9], [9]])
    prompts, params = FakeLLM.instances[-1].requests[-1]
    assert prompts == [{"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [9]}]
    assert [p.n for p in params] == [2, 2]
    assert params[1].seed == params[0].seed + 2
    assert out.completion_ids.shape == (4, 2)

    FakeLLM.script = [([5, EOS], "stop")] * 3
    gen.generate([[7], [9], [7]])
    prompts, params = FakeLLM.instances[-1].requests[-1]
    assert len(prompts) == 3 and [p.n for p in params] == [1, 1, 1]


def test_group_repeats() -> None:
    assert group_repeats([[1], [1], [2], [2]]) == ([[1], [2]], 2)
    assert group_repeats([[1], [1], [2]]) == ([[1], [1], [2]], 1)
    assert group_repeats([[1], [2]]) == ([[1], [2]], 1)


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


# -- the engine's starting checkpoint -----------------------------------------------------------------


def test_engine_is_built_from_the_policy(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"gpu_memory_utilization": 0.5, "engine_kwargs": {"max_num_seqs": 64}})
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["dtype"] == "float32" and llm.kwargs["seed"] == 11
    assert llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.kwargs["max_num_seqs"] == 64
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert "enable_sleep_mode" not in llm.kwargs
    # A random initialisation has no folder: it is written once for the engine to read.
    source = Path(llm.kwargs["model"])
    assert (source / "config.json").is_file() and llm.kwargs["tokenizer"] == str(source)
    assert (source / "tokenizer_config.json").is_file()
    state = model.state_dict()
    assert llm.checkpoint.keys() == state.keys()
    assert all(torch.equal(llm.checkpoint[n], state[n]) for n in state)
    assert llm.engine_model.load_calls == 0  # it starts with the policy's weights: no sync needed


def test_starting_the_engine_leaves_the_global_rngs_alone(fake_vllm, tiny_model: dict) -> None:
    model, tokenizer = load_model(tiny_model)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    VLLMGenerator().setup(model, tokenizer, SamplingSettings(seed=2**40))
    assert FakeLLM.instances[-1].kwargs["seed"] == 0  # 2**40 mod 2**32
    assert torch.equal(torch.rand(3), expected[0]) and (random.random(), np.random.rand()) == expected[1:]


def test_a_local_checkpoint_is_handed_to_the_engine_as_is(fake_vllm, tiny_model: dict, tmp_path) -> None:
    model, tokenizer = load_model(tiny_model)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    _setup(str(tmp_path / "ckpt"))
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["model"] == str(tmp_path / "ckpt")
    # The folder may hold other weights than the policy's (e.g. a LoRA's base): synced at setup.
    assert llm.engine_model.load_calls == 1 and llm.events[-1] == ("reset_prefix_cache",)


def test_lora_over_a_random_init_starts_the_engine_from_merged_weights(fake_vllm, tiny_model: dict) -> None:
    model, tokenizer = load_model(tiny_model, seed=0, lora={"r": 2, "lora_alpha": 4})
    _move_adapters(model)
    gen = VLLMGenerator(VLLMGeneratorParams(sync_weights=False))
    gen.setup(model, tokenizer, SamplingSettings(max_completion_length=6))  # the fake rejects peft names
    checkpoint = FakeLLM.instances[-1].checkpoint
    assert checkpoint.keys() == load_model(tiny_model)[0].state_dict().keys()  # every weight, base names
    torch.testing.assert_close(checkpoint[Q_PROJ], _merged_q_proj(model))


def test_a_model_built_from_a_config_gets_its_architecture_written(fake_vllm, tmp_path) -> None:
    spec = tiny_model_spec(tmp_path, "qwen2", architectures=None)  # as AutoModel.from_config builds it
    gen, model, _ = _setup(spec)
    assert not model.config.architectures
    assert FakeLLM.instances[-1].config["architectures"] == ["Qwen2ForCausalLM"]


def test_tied_weights_are_written_once(fake_vllm, tmp_path) -> None:
    spec = tiny_model_spec(tmp_path, "qwen2", tie_word_embeddings=True)
    gen, model, _ = _setup(spec)
    checkpoint = FakeLLM.instances[-1].checkpoint
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in checkpoint
    assert torch.equal(checkpoint["model.embed_tokens.weight"], model.state_dict()["lm_head.weight"])


def test_close_shuts_the_engine_down_and_removes_the_checkpoint(fake_vllm, tiny_model: dict) -> None:
    gen, _, _ = _setup(tiny_model)
    llm = FakeLLM.instances[-1]
    shutdowns: list[bool] = []
    llm.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: shutdowns.append(True)))
    source = Path(llm.kwargs["model"])
    gen.close()
    assert shutdowns == [True] and gen.llm is None and not source.exists()


# -- weight sync ------------------------------------------------------------------------------------


def test_weight_sync_goes_through_reload_weights_with_an_iterator(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model)
    llm = FakeLLM.instances[-1]
    gen.on_weights_updated(model)
    assert [m for m, _ in llm.rpc_calls] == ["reload_weights"]
    assert llm.rpc_calls[-1][1]["is_checkpoint_format"] is True
    assert ("apply_model",) not in llm.events and llm.events[-1] == ("reset_prefix_cache",)
    torch.testing.assert_close(llm.engine_model.loaded[Q_PROJ], model.state_dict()[Q_PROJ])
    assert gen.stats["syncs"] == 1 and gen.stats["sync_seconds"] >= 0


def test_an_older_vllm_syncs_through_apply_model(monkeypatch, vllm_env, tiny_model: dict) -> None:
    FakeLLM.instances, FakeLLM.script = [], []
    for name, module in _fake_vllm(OldGPUModelRunner).items():
        monkeypatch.setitem(sys.modules, name, module)
    gen, model, _ = _setup(tiny_model)
    gen.on_weights_updated(model)
    llm = FakeLLM.instances[-1]
    assert llm.rpc_calls == [] and llm.events.count(("apply_model",)) == 1
    assert llm.engine_model.load_calls == 1


def test_weight_sync_can_be_forced_to_load_weights(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"weight_sync": "load_weights"})
    gen.on_weights_updated(model)
    llm = FakeLLM.instances[-1]
    assert llm.rpc_calls == [] and llm.events.count(("apply_model",)) == 1


def test_weight_sync_loads_merged_lora_weights_under_base_names(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, lora={"r": 2, "lora_alpha": 4})
    _move_adapters(model)
    before = {n: t.clone() for n, t in model.get_base_model().state_dict().items()}
    gen.on_weights_updated(model)
    llm = FakeLLM.instances[-1]
    loaded = llm.engine_model.loaded
    assert llm.engine_model.load_calls == 1 and llm.events.count(("reset_prefix_cache",)) == 1
    assert not any("lora_" in n or "base_layer" in n for n in loaded)
    torch.testing.assert_close(loaded[Q_PROJ], _merged_q_proj(model))
    after = model.get_base_model().state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the policy itself is untouched


def test_sync_weights_off_loads_nothing(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"sync_weights": False})
    gen.on_weights_updated(model)
    assert FakeLLM.instances[-1].engine_model.load_calls == 0


def test_policy_weights_of_a_plain_model_are_its_state_dict(tiny_model: dict) -> None:
    model, _ = load_model(tiny_model)
    names = [n for n, _ in policy_weights(model)]
    assert names == list(model.state_dict())


# -- sleep mode -------------------------------------------------------------------------------------


def test_sleep_mode_sleeps_after_generation_and_syncs_between_the_two_wake_ups(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"enable_sleep_mode": True})
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["enable_sleep_mode"] is True and gen.sleep_level == 2
    FakeLLM.script = [([5, EOS], "stop")] * 4
    llm.events.clear()
    gen.generate([[7], [7]])
    with torch.no_grad():  # an optimizer step while the engine sleeps
        model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    gen.on_weights_updated(model)  # deferred: the engine's weights are released
    gen.generate([[7], [7]])
    assert llm.events == [
        ("generate",), ("sleep", 2),
        ("wake_up", ["weights"]), ("load",), ("wake_up", ["kv_cache"]), ("generate",), ("sleep", 2),
    ]
    torch.testing.assert_close(llm.engine_model.last_load[Q_PROJ], model.state_dict()[Q_PROJ])


def test_level_2_sleep_reloads_the_weights_even_without_an_update(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"enable_sleep_mode": True})
    llm = FakeLLM.instances[-1]
    FakeLLM.script = [([5, EOS], "stop")] * 4
    llm.events.clear()
    gen.generate([[7], [7]])
    gen.generate([[7], [7]])  # no optimizer step in between: the discarded weights still come back
    assert llm.events[2:5] == [("wake_up", ["weights"]), ("load",), ("wake_up", ["kv_cache"])]
    torch.testing.assert_close(llm.engine_model.last_load[Q_PROJ], model.state_dict()[Q_PROJ])


def test_level_1_sleep_without_sync_wakes_everything_at_once(fake_vllm, tiny_model: dict) -> None:
    gen, model, _ = _setup(tiny_model, params={"enable_sleep_mode": True, "sync_weights": False})
    llm = FakeLLM.instances[-1]
    FakeLLM.script = [([5, EOS], "stop")] * 4
    gen.generate([[7], [7]])
    gen.on_weights_updated(model)
    gen.generate([[7], [7]])
    assert gen.sleep_level == 1
    assert llm.events == [("generate",), ("sleep", 1), ("wake_up", None), ("generate",), ("sleep", 1)]
    assert gen.stats["sleep_seconds"] > 0 and gen.stats["wake_seconds"] > 0


def test_sleep_level_2_without_sync_is_refused() -> None:
    with pytest.raises(ValueError, match="sleep_level 2.*sync_weights: true"):
        VLLMGeneratorParams(enable_sleep_mode=True, sleep_level=2, sync_weights=False)


# -- environment, availability ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flashinfer", "preset", "expected"),
    [(False, None, "0"), (True, None, None), (False, "1", "1")],
    ids=["no-flashinfer", "flashinfer", "user-setting-wins"],
)
def test_flashinfer_sampler_is_switched_off_when_flashinfer_is_missing(
    fake_vllm, monkeypatch, tiny_model: dict, flashinfer: bool, preset: str | None, expected: str | None
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer") if flashinfer else None)
    if preset is not None:
        monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", preset)
    _setup(tiny_model)
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == expected
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_without_vllm_setup_says_so(monkeypatch, vllm_env, tiny_model: dict) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    model, tokenizer = load_model(tiny_model)
    with pytest.raises(GeneratorUnavailableError, match="needs vLLM.*fast_inference: false"):
        VLLMGenerator().setup(model, tokenizer, SamplingSettings())


def test_it_asks_for_the_rollout_correction() -> None:
    assert VLLMGenerator.samples_from_policy is False


def test_the_vllm_extra_admits_only_versions_with_logprobs_mode() -> None:
    import tomllib

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    (requirement,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    assert not requirement.specifier.contains("0.10.1") and requirement.specifier.contains("0.10.2")
    assert requirement.specifier.contains("0.26.0")


# -- bench/check_vllm.py ----------------------------------------------------------------------------


def test_the_gpu_check_runs_its_parts_against_the_fake(fake_vllm, monkeypatch, tmp_path, tiny_model: dict) -> None:
    import bench._common as common
    from bench import check_vllm

    monkeypatch.setattr(common, "TINY", True)
    monkeypatch.setattr(common, "TOKENIZER_DIR", Path(tiny_model["tokenizer"]))
    FakeLLM.default = ([5, 6, EOS], "stop")
    args = check_vllm.parse_args(
        ["--out", str(tmp_path / "check.json"), "--parts", "sync", "lora", "--steps", "2", "--completions", "8",
         "--tokens", "4", "--lora-steps", "1"]
    )
    records = {name: check_vllm.run(name, **kwargs) for name, kwargs in check_vllm.planned_runs(args)}
    sync, lora = records["sync"], records["lora"]
    assert [m["step"] for m in sync["mismatch"]] == [1, 2]
    assert all(m["tokens"] == 8 * 3 and m["abs_mean"] > 0 for m in sync["mismatch"])  # 8 completions of 3 tokens
    assert all(r["min"] <= r["mean"] <= r["max"] for r in sync["is_ratio"])
    assert sync["generator_stats"]["syncs"] == 2  # after each of the 2 steps
    assert lora["generator_stats"]["syncs"] == 1 and lora["settings"]["lora"]["r"] == 16
    assert len(FakeLLM.instances) == 2 and not any(Path(llm.kwargs["model"]).exists() for llm in FakeLLM.instances)
    check_vllm.RESULTS["runs"] = records
    assert "sync" in check_vllm.table() and "lora" in check_vllm.table()


@dataclass
class FlatLogprobs:
    """vLLM's flat log-prob container (its fields only): per position i, entries
    ``start_indices[i]:end_indices[i]`` of the flat lists."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]


def test_flat_logprobs_are_asked_for_where_vllm_has_them_and_read_without_dicts(
    fake_vllm, tiny_model: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_plugins.generators.vllm_backend import sampled_logprobs

    gen, _, _ = _setup(tiny_model)
    assert "flat_logprobs" not in gen.sampling_params(2, None).kwargs  # an older vLLM: not a field
    monkeypatch.setattr(SamplingParams, "__struct_fields__", ("n", "logprobs", "flat_logprobs"), raising=False)
    assert gen.sampling_params(2, None).kwargs["flat_logprobs"] is True

    tokens = [5, 9, 2]
    # Position 1 also holds a top-k entry before the sampled token: the sampled token is looked up.
    flat = FlatLogprobs([0, 1, 3], [1, 3, 4], [5, 4, 9, 2], [-0.5, -0.25, -1.75, -3.0])
    per_position = [{5: -0.5}, {4: -0.25, 9: -1.75}, {2: -3.0}]
    assert sampled_logprobs(flat, tokens) == sampled_logprobs(per_position, tokens) == [-0.5, -1.75, -3.0]
    with pytest.raises(KeyError, match="sampled token 7 at position 0"):
        sampled_logprobs(flat, [7])


def test_memory_advice_names_the_engines_share_and_sleep_mode() -> None:
    """An out-of-memory error lists the colocated engine's memory share, and sleep mode outside
    generation while it is off; a server's memory is its own, so it lists nothing."""
    def keys(gen: VLLMGenerator, phase: str) -> list[str]:
        return [a.split(" ")[0] for a in gen.memory_advice(phase)]

    colocated = VLLMGenerator(VLLMGeneratorParams(gpu_memory_utilization=0.4))
    assert keys(colocated, "generation") == ["generator.params.gpu_memory_utilization"]
    assert "(0.4;" in colocated.memory_advice("generation")[0]
    assert keys(colocated, "training") == ["generator.params.gpu_memory_utilization", "generator.params.enable_sleep_mode"]
    sleeping = VLLMGenerator(VLLMGeneratorParams(enable_sleep_mode=True))
    assert keys(sleeping, "training") == ["generator.params.gpu_memory_utilization"]
    assert VLLMGenerator(VLLMGeneratorParams(mode="server")).memory_advice("training") == []
