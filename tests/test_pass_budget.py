"""``train_pass_tokens: auto``: the activation estimate per token, the budget from the device
memory left (sized once, less what the first optimizer step will allocate), none on a CPU, a
run whose micro-batches it splits keeping the gradient, and a resumed run keeping the budget."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import test_length_grouping as grouping
from grpo_plugins import pass_budget
from grpo_plugins.config import GRPOConfig
from grpo_plugins.pass_budget import PassBudget, activation_bytes_per_token, pending_optimizer_bytes
from grpo_plugins.policy import Policy

GiB = 2**30


class _Model(torch.nn.Module):
    """Qwen2.5-0.5B's sizes on a one-parameter module."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> None:
        super().__init__()
        sizes = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, head_dim=None)
        self.config = SimpleNamespace(**{**sizes, **overrides})
        self.w = torch.nn.Parameter(torch.zeros(4, dtype=dtype))


def test_activations_per_token_follow_the_layer_sizes() -> None:
    model = _Model()
    qkv = (14 + 2 * 2) * 64
    per_layer = 4 * 4864 + 2 * 896 + qkv  # values a compiled layer keeps per token
    assert activation_bytes_per_token(model, checkpointing=False) == (24 * per_layer + 4 * 896) * 2
    # an H100's peak grew by 0.98 MB per added token (bench/RESULTS.md); the estimate is a little above
    assert 0.98e6 < activation_bytes_per_token(model, checkpointing=False) < 1.15e6
    assert activation_bytes_per_token(model, checkpointing=True) == (24 * 896 + per_layer + 4 * 896) * 2
    assert activation_bytes_per_token(model, checkpointing=True, offload=True) == (per_layer + 4 * 896) * 2
    assert activation_bytes_per_token(model, checkpointing=False, compiled=False) > activation_bytes_per_token(model, checkpointing=False)
    assert activation_bytes_per_token(_Model(torch.float32), checkpointing=False) == 2 * activation_bytes_per_token(model, checkpointing=False)
    assert activation_bytes_per_token(_Model(intermediate_size=None), checkpointing=False) is None


def test_a_vision_language_model_is_sized_by_its_text_config() -> None:
    model = _Model()
    text = model.config
    model.config = SimpleNamespace(text_config=text)
    assert activation_bytes_per_token(model, checkpointing=False) == activation_bytes_per_token(_Model(), checkpointing=False)


def test_the_first_optimizer_step_is_kept_free_until_the_optimizer_has_state() -> None:
    params = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(5))]
    optimizer = torch.optim.AdamW(params)
    assert pending_optimizer_bytes(params, optimizer) == 15 * pass_budget.PENDING_BYTES_PER_PARAMETER
    sum(p.sum() for p in params).backward()
    optimizer.step()
    assert pending_optimizer_bytes(params, optimizer) == 0


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int, total: int, reserved: int, allocated: int) -> list[int]:
    calls: list[int] = []

    def mem_get_info(device: Any) -> tuple[int, int]:
        calls.append(1)
        return free, total

    monkeypatch.setattr(pass_budget.torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(pass_budget.torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(pass_budget.torch.cuda, "memory_allocated", lambda device: allocated)
    return calls


def test_the_budget_is_the_memory_left_over_the_activations_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_cuda(monkeypatch, free=50 * GiB, total=80 * GiB, reserved=12 * GiB, allocated=10 * GiB)
    model = _Model()
    trainable = [torch.nn.Parameter(torch.zeros(1000))]
    budget = PassBudget(model, trainable, torch.optim.AdamW(trainable), torch.device("cuda", 0), checkpointing=False)
    per_token = activation_bytes_per_token(model, checkpointing=False)
    left = 50 * GiB + 2 * GiB - 1000 * pass_budget.PENDING_BYTES_PER_PARAMETER - int(0.1 * 80 * GiB)
    assert budget.tokens() == left // per_token
    assert 40_000 < budget.tokens() < 50_000  # 0.5B without checkpointing: about 44k tokens here
    _fake_cuda(monkeypatch, free=1 * GiB, total=80 * GiB, reserved=0, allocated=0)
    assert budget.tokens() == left // per_token and len(calls) == 1  # sized once for the run


def test_a_device_without_room_still_gets_passes_and_a_cpu_no_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=1 * GiB, total=80 * GiB, reserved=0, allocated=0)
    cuda = PassBudget(_Model(), [], None, torch.device("cuda", 0), checkpointing=False)
    assert cuda.tokens() == 2  # one row a pass, then the out-of-memory guard names the settings
    assert PassBudget(_Model(), [], None, torch.device("cpu"), checkpointing=False).tokens() is None


def test_the_policy_asks_the_budget_once() -> None:
    asked: list[int] = []

    def budget() -> int:
        asked.append(1)
        return 4096

    policy = Policy(None, None, None, False, lambda: None, None, pass_budget=budget)  # type: ignore[arg-type]
    assert policy.pass_tokens() == 4096 and policy.pass_tokens() == 4096 and asked == [1]
    assert Policy(None, None, None, False, lambda: None, None, max_pass_tokens=96).pass_tokens() == 96  # type: ignore[arg-type]


def test_auto_is_the_default_and_a_number_or_none_still_set_it() -> None:
    assert GRPOConfig().train_pass_tokens == "auto"
    assert GRPOConfig(train_pass_tokens=8192).train_pass_tokens == 8192
    assert GRPOConfig(train_pass_tokens=None).train_pass_tokens is None
    with pytest.raises(Exception, match="train_pass_tokens"):
        GRPOConfig(train_pass_tokens="half")


def test_a_run_split_by_the_budget_keeps_the_gradient(tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget as a CUDA device would size it (160 tokens), on the CPU run of test_length_grouping."""
    sized: list[int] = []

    def size(self: PassBudget) -> int:
        sized.append(1)
        return 160

    monkeypatch.setattr(PassBudget, "_size", size)
    whole_grads, whole_shapes = grouping._train(tiny_model, tmp_path, grouped=False, train_pass_tokens=None)
    auto_grads, auto_shapes = grouping._train(tiny_model, tmp_path, grouped=False)
    assert [rows for rows, _ in whole_shapes] == [16, 16] and whole_shapes[0][1] * 16 > 160
    assert len(auto_shapes) > 2 * 2 and all(rows * columns <= 160 for rows, columns in auto_shapes), auto_shapes
    assert sized == [1]  # once for the run
    for step_whole, step_auto in zip(whole_grads, auto_grads, strict=True):
        scale = max(g.abs().max().item() for g in step_whole)
        for a, b in zip(step_whole, step_auto, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale)


def test_a_resumed_run_plans_with_the_budget_its_first_run_sized(tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is saved with the checkpoint: after a resume the device's memory differs
    (the optimizer's state is loaded already), but the passes must stay those of the run."""
    from grpo_plugins.engine import Engine
    from grpo_plugins.models import load_model
    from grpo_plugins.testing import ScriptedGenerator, registered_component

    sizes = iter([160, 10_000])
    monkeypatch.setattr(PassBudget, "_size", lambda self: next(sizes))
    grouping._reply.count = 0  # type: ignore[attr-defined]

    class Scripted(ScriptedGenerator):
        def __init__(self) -> None:
            super().__init__(grouping._reply)

    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "run"), "save_steps": 1,
        "per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 40,
        "learning_rate": 1e-3, "report_to": [], "seed": 0, "generator": "lengths", "group_by_length": False,
    }
    shapes: list[tuple[int, int]] = []

    def engine(max_steps: int) -> Engine:
        model, tok = load_model(tiny_model, dtype="float32", seed=0)
        model.get_decoder().register_forward_pre_hook(
            lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)) if torch.is_grad_enabled() else None, with_kwargs=True
        )
        return Engine({**config, "max_steps": max_steps}, model=model, tokenizer=tok, rewards=[grouping._score], dataset=grouping.PROMPTS)

    with registered_component("generator", Scripted, "lengths"):
        engine(1).train()
        first = list(shapes)
        shapes.clear()
        engine(2).train(resume=True)
    assert first and shapes and all(rows * columns <= 160 for rows, columns in first + shapes), (first, shapes)
    assert next(sizes) == 10_000  # the resumed run did not size a budget of its own


def test_out_of_memory_advice_names_what_auto_picked(tiny_model: dict) -> None:
    from grpo_plugins.guards import out_of_memory_advice

    def pass_advice(config: GRPOConfig, picked: int | None) -> str:
        return next(a for a in out_of_memory_advice(config, "training", pass_tokens=picked) if a.startswith("train_pass_tokens"))

    auto = GRPOConfig(model=tiny_model)
    assert pass_advice(auto, 12_000).startswith("train_pass_tokens (auto: 12000; e.g. 6000:")
    assert pass_advice(auto, None).startswith("train_pass_tokens (auto; e.g. 8192:")  # not sized (a CPU)
    assert pass_advice(GRPOConfig(model=tiny_model, train_pass_tokens=4000), 12_000).startswith("train_pass_tokens (4000; e.g. 2000:")
    from grpo_plugins.guards import RunGuard

    guard = RunGuard(auto, ["r"])
    guard.pass_tokens = lambda: 12_000
    assert "train_pass_tokens (auto: 12000; e.g. 6000" in str(guard._oom_error("training", 3, RuntimeError("CUDA out of memory")))
