"""float32 master weights: small updates to 16-bit weights are kept, not rounded away."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpo_plugins.engine import Engine
from grpo_plugins.precision import MasterWeights, needs_master_weights

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c if isinstance(c, str) else c[0]["content"])) % 7) for c in completions]


def _adamw_steps(params: list[torch.Tensor], grads: list[torch.Tensor], steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()


def test_a_1e_6_update_is_lost_in_bf16_and_kept_with_master_weights() -> None:
    start = torch.full((4, 4), 0.5, dtype=torch.bfloat16)
    grad = torch.full((4, 4), 0.25, dtype=torch.bfloat16)

    pure = start.clone().requires_grad_(True)
    _adamw_steps([pure], [grad], steps=50, lr=1e-6)
    assert torch.equal(pure.detach(), start)  # 50 updates of ~1e-6 each, all rounded away

    weight = start.clone().requires_grad_(True)
    master = MasterWeights([weight])
    assert master.params[0].dtype == torch.float32
    optimizer = torch.optim.AdamW(master.params, lr=1e-6, weight_decay=0.0)
    for _ in range(50):
        weight.grad = grad.clone()
        master.grads_to_masters()
        assert weight.grad is None and master.params[0].grad.dtype == torch.float32
        optimizer.step()
        master.masters_to_params()
    moved = 0.5 - master.params[0]  # AdamW moves by ~lr per step against the gradient's sign
    torch.testing.assert_close(moved, torch.full_like(moved, 50e-6), rtol=5e-2, atol=0)
    assert weight.dtype == torch.bfloat16


def test_master_updates_accumulate_until_the_bf16_weight_moves() -> None:
    weight = torch.full((8,), 0.5, dtype=torch.bfloat16, requires_grad=True)
    master = MasterWeights([weight])
    optimizer = torch.optim.SGD(master.params, lr=1.0)
    for _ in range(1200):  # 1200 x 1e-6 = 1.2e-3, past half a bf16 ulp at 0.5 (2**-9 = 1.95e-3 / 2)
        weight.grad = torch.full_like(weight, 1e-6)
        master.grads_to_masters()
        optimizer.step()
        master.masters_to_params()
    assert float(weight.detach()[0]) < 0.5
    step = float(torch.tensor(1e-6, dtype=torch.bfloat16))  # the gradient as bf16 holds it
    torch.testing.assert_close(master.params[0], torch.full((8,), 0.5 - 1200 * step), rtol=0, atol=5e-5)


def test_float32_parameters_are_their_own_master() -> None:
    lora = torch.zeros(3, requires_grad=True)
    base = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    master = MasterWeights([lora, base])
    assert master.params[0] is lora and master.params[1] is not base
    assert needs_master_weights([lora, base]) and not needs_master_weights([lora])
    assert len(master.state_dict()["masters"]) == 1


def _config(tiny_model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": tiny_model,
        "dtype": "bfloat16",
        "task": None,
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "steps_per_generation": 2,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-6,
        "report_to": ["jsonl"],
        "seed": 0,
    }
    base.update(overrides)
    return base


def _train(config: dict[str, Any], resume: Any = None) -> Engine:
    engine = Engine(config, rewards=[char_sum], dataset=PROMPTS)
    engine.train(resume=resume)
    return engine


def test_bf16_full_finetuning_at_lr_1e_6_moves_the_weights_only_with_master_weights(tiny_model: dict, tmp_path: Path) -> None:
    lost = _train(_config(tiny_model, tmp_path / "a", master_weights=False))
    kept = _train(_config(tiny_model, tmp_path / "b"))
    assert lost.master is None and kept.master is not None
    from grpo_plugins.models import load_model

    initial, _ = load_model(tiny_model, dtype="bfloat16", seed=0)
    before = dict(initial.named_parameters())
    lost_params = dict(lost.unwrapped.named_parameters())
    names = [n for n, p in kept.unwrapped.named_parameters() if p.requires_grad]
    masters = dict(zip(names, kept.master.params))
    moved_count = total = 0
    for name, w0 in before.items():
        if w0.dim() < 2:
            continue
        # Where half a bf16 ulp (>= 2**-16 for |w| >= 2**-8) exceeds two AdamW steps of ~1e-6,
        # pure bf16 loses every update; the float32 master keeps them.
        big = w0.detach().float().abs() >= 2**-8
        assert torch.equal(lost_params[name].detach()[big], w0.detach()[big]), name
        moved = (masters[name] - w0.detach().float())[big].abs()
        assert float(moved.max()) < 1e-5, name
        moved_count += int((moved > 1e-7).sum())
        total += int(big.sum())
    assert moved_count > 0.5 * total  # (embedding rows of tokens never seen get no gradient)


def test_bf16_resume_restores_the_master_weights_exactly(tiny_model: dict, tmp_path: Path) -> None:
    full = _train(_config(tiny_model, tmp_path / "full", max_steps=4, learning_rate=1e-5))
    _train(_config(tiny_model, tmp_path / "part", max_steps=4, learning_rate=1e-5, save_steps=2))
    checkpoint = tmp_path / "part" / "out" / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "master_weights.pt").is_file()
    resumed = _train(_config(tiny_model, tmp_path / "part", max_steps=4, learning_rate=1e-5), resume=checkpoint)
    for a, b in zip(full.master.params, resumed.master.params):
        assert torch.equal(a, b)
    for (n, a), (_, b) in zip(full.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(a, b), n


def test_master_weights_live_on_the_training_device_when_the_model_arrives_elsewhere(
    tiny_model: dict, tmp_path: Path, monkeypatch: Any
) -> None:
    # The meta device stands in for a GPU: the model is loaded on the CPU, as the vllm
    # generator's path leaves it, and everything the optimizer steps must end up on the device.
    from accelerate import Accelerator

    from grpo_plugins.config import load_config
    from grpo_plugins.run_parts import load_policy
    from grpo_plugins.runtime import make_accelerator

    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("meta")))
    config = load_config(_config(tiny_model, tmp_path))
    accelerator, _ = make_accelerator(config)
    policy = load_policy(config, accelerator)
    assert policy.master is not None
    model_devices = {p.device.type for p in policy.unwrapped.parameters()}
    stepped_devices = {p.device.type for group in policy.optimizer.param_groups for p in group["params"]}
    assert model_devices == {"meta"} and stepped_devices == {"meta"}


def test_lora_in_the_model_dtype_trains_16_bit_adapters_through_float32_masters(tiny_model: dict, tmp_path: Path) -> None:
    lora = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    default = _train(_config(tiny_model, tmp_path / "a", lora=lora, learning_rate=1e-4))
    sixteen = _train(_config(tiny_model, tmp_path / "b", lora={**lora, "dtype": "model"}, learning_rate=1e-4))
    adapters = [p for p in default.unwrapped.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    assert default.master is None  # float32 adapters are their own masters
    adapters16 = [p for p in sixteen.unwrapped.parameters() if p.requires_grad]
    assert len(adapters16) == len(adapters) and all(p.dtype == torch.bfloat16 for p in adapters16)
    assert sixteen.master is not None
    assert all(m.dtype == torch.float32 for m in sixteen.master.params)
    # The adapters learned, and each 16-bit adapter is its master rounded to bfloat16.
    for p, m in zip(adapters16, sixteen.master.params):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    # lora_B starts at zero: its masters moved, so the 16-bit run learned.
    names = [n for n, p in sixteen.unwrapped.named_parameters() if p.requires_grad]
    b_masters = [m for n, m in zip(names, sixteen.master.params) if "lora_B" in n]
    assert b_masters and all(float(m.abs().max()) > 0 for m in b_masters)


def test_lora_dtype_is_validated() -> None:
    import pydantic
    import pytest

    from grpo_plugins.config import GRPOConfig

    assert GRPOConfig.model_validate({"lora": {"dtype": "model"}}).lora.dtype == "model"
    with pytest.raises(pydantic.ValidationError, match="lora.dtype"):
        GRPOConfig.model_validate({"lora": {"dtype": "bfloat16"}})
