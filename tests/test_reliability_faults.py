"""Faults inside a run: device out-of-memory and non-finite values (issue 8).

Out-of-memory is simulated by making the generator or the training forward raise
``torch.OutOfMemoryError``; non-finite values come from a reward, a loss type and a backward
pass that produce them on purpose.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.checkpoint import latest_checkpoint, resolve_resume
from grpo_plugins.cli import main
from grpo_plugins.engine import Engine
from grpo_plugins.guards import DeviceOutOfMemoryError, NonFiniteError, RunGuard
from grpo_plugins.kinds import LossType
from grpo_plugins.metrics import read_metrics
from grpo_plugins.models import load_model
from grpo_plugins.registry import get_registry

sys.path.insert(0, str(Path(__file__).parent))
from kill_points import before_each_generation  # noqa: E402

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(tiny_model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": tiny_model,
        "task": None,
        "output_dir": str(tmp_path / "out"),
        "max_steps": 4,
        "save_steps": 1,
        "save_total_limit": None,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": 4,
        "max_completion_length": 5,
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "seed": 0,
    }
    base.update(overrides)
    return base


def _model(tiny_model: dict) -> tuple[Any, Any]:
    return load_model(tiny_model, dtype="float32", seed=0)


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _unchanged(before: dict[str, torch.Tensor], model: Any) -> bool:
    return all(torch.equal(before[k], v.detach()) for k, v in model.named_parameters())


def _all_finite(model: Any, optimizer: Any = None) -> bool:
    tensors = [p.detach() for p in model.parameters()]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# -- out of memory ---------------------------------------------------------------------------------


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")


def _fail_generation_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    calls = [0]

    def count() -> None:
        calls[0] += 1
        if calls[0] == call:
            raise _oom()

    before_each_generation(count, monkeypatch.setattr)


def _fail_training_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    import grpo_plugins.logprobs

    original = grpo_plugins.logprobs.completion_logps
    calls = [0]

    def completion_logps(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == call:
                raise _oom()
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo_plugins.logprobs, "completion_logps", completion_logps)


def _assert_checkpoint_intact(output_dir: Path, step: int) -> None:
    checkpoint = latest_checkpoint(output_dir)
    assert checkpoint is not None and checkpoint.name == f"checkpoint-{step}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step
    assert not [p for p in (output_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_oom_during_generation_names_the_settings_and_keeps_the_checkpoint(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_generation_at(monkeypatch, 3)
    cfg = _config(tiny_model, tmp_path)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        Engine(cfg, rewards=[char_sum], dataset=PROMPTS).train()
    message = str(info.value)
    assert "out of device memory during generation of optimizer step 3" in message
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in message
    for knob in ("steps_per_generation (1;", "max_completion_length (5)", "per_device_train_batch_size (4)"):
        assert knob in message, knob
    assert "checkpoint-2" in message and "--resume" in message
    assert info.value.phase == "generation" and info.value.step == 3
    _assert_checkpoint_intact(tmp_path / "out", 2)

    monkeypatch.undo()  # memory freed: the run continues from the checkpoint and finishes
    result = Engine(cfg, rewards=[char_sum], dataset=PROMPTS).train(resume=True)
    assert result.global_step == 4


def test_oom_during_training_names_the_settings(tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_training_at(monkeypatch, 2)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        Engine(_config(tiny_model, tmp_path), rewards=[char_sum], dataset=PROMPTS).train()
    message = str(info.value)
    assert "out of device memory during training of optimizer step 2" in message
    for knob in ("per_device_train_batch_size (4;", "gradient_accumulation_steps", "max_completion_length (5)",
                 "logprob_chunk_size (1024)", "gradient_checkpointing (set it to true)",
                 "train_chunk_rows (None; e.g. 1:"):
        assert knob in message, knob
    _assert_checkpoint_intact(tmp_path / "out", 1)


def test_oom_through_the_cli_exits_non_zero_without_a_traceback(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    _fail_generation_at(monkeypatch, 2)
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    cfg = _config(tiny_model, tmp_path, dataset={"path": "json", "data_files": str(rows)}, rewards=["test_reliability_faults:char_sum"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["train", str(tmp_path / "run.yaml")])
    out, err = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in out + err
    err = " ".join(err.split())
    assert "error: out of device memory during generation of optimizer step 2" in err
    assert "checkpoint-1" in err


# -- non-finite values -------------------------------------------------------------------------------


def _huge_on_call(calls: int) -> Any:
    """A reward that scores one sample 1e308 (inf in float32) on its ``calls``-th call."""
    seen = [0]

    def huge(completions: list[Any], **kwargs: Any) -> list[float]:
        seen[0] += 1
        out = char_sum(completions)
        if seen[0] == calls:
            out[1] = 1e308
        return out

    return huge


def test_inf_reward_stops_before_the_optimizer_step(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    engine = Engine(_config(tiny_model, tmp_path, save_steps=None), model=model, tokenizer=tok,
                    rewards=[_huge_on_call(1)], dataset=PROMPTS)
    with pytest.raises(NonFiniteError) as info:
        engine.train()
    assert (info.value.step, info.value.component) == (1, "reward 'huge'")
    assert "non-finite reward at optimizer step 1, produced by reward 'huge'" in str(info.value)
    assert "sample(s) [1]" in str(info.value)
    assert _unchanged(before, model)


def test_stopping_on_a_bad_reward_saves_the_last_good_step_and_resumes(tiny_model: dict, tmp_path: Path) -> None:
    cfg = _config(tiny_model, tmp_path, save_steps=None)
    with pytest.raises(NonFiniteError, match="optimizer step 3"):
        Engine(cfg, rewards=[_huge_on_call(3)], dataset=PROMPTS).train()
    _assert_checkpoint_intact(tmp_path / "out", 2)
    result = Engine(cfg, rewards=[char_sum], dataset=PROMPTS).train(resume=True)
    assert result.global_step == 4


def test_inf_reward_with_skip_skips_that_step_only(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    engine = Engine(_config(tiny_model, tmp_path, on_nonfinite="skip", max_steps=3), model=model, tokenizer=tok,
                    rewards=[_huge_on_call(2)], dataset=PROMPTS)
    engine.train()
    records = read_metrics(tmp_path / "out")
    assert [r["nonfinite_skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert all(math.isfinite(v) for r in records for v in r.values())
    assert _all_finite(model, engine.optimizer)


class NaNLoss(LossType):
    """Test stand-in: a loss type whose loss is NaN."""

    def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
        return (per_token_loss * inputs.mask).sum() * float("nan")


class NaNGradient(LossType):
    """Test stand-in: a finite loss (0) whose gradient is NaN (sqrt at 0 times a zero sign)."""

    def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
        total = (per_token_loss * inputs.mask).sum()
        return (total - total.detach()).abs().sqrt()


def test_nan_loss_stops_naming_the_loss_type(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    registry = get_registry()
    with registry.temporary("loss_type", "nan_loss", NaNLoss):
        engine = Engine(_config(tiny_model, tmp_path, loss_type="nan_loss"), model=model, tokenizer=tok,
                        rewards=[char_sum], dataset=PROMPTS, registry=registry)
        with pytest.raises(NonFiniteError) as info:
            engine.train()
    assert (info.value.step, info.value.component) == (1, "loss_type 'nan_loss'")
    assert _unchanged(before, model)
    assert latest_checkpoint(tmp_path / "out") is None  # nothing non-finite was saved either


def test_nan_gradient_with_a_finite_loss_is_caught_and_skipped(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    registry = get_registry()
    with registry.temporary("loss_type", "nan_grad", NaNGradient):
        cfg = _config(tiny_model, tmp_path, loss_type="nan_grad", max_steps=2)
        with pytest.raises(NonFiniteError) as info:
            Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS, registry=registry).train()
        assert info.value.step == 1 and info.value.component.startswith("the backward pass (parameter(s) ")
        assert "model." in info.value.component  # names the parameters whose gradients are NaN
        assert _unchanged(before, model)

        cfg = _config(tiny_model, tmp_path / "skip", loss_type="nan_grad", max_steps=2, on_nonfinite="skip")
        engine = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS, registry=registry)
        engine.train()
    assert _unchanged(before, model)
    assert _all_finite(model, engine.optimizer)
    assert [r["nonfinite_skipped"] for r in read_metrics(tmp_path / "skip" / "out")] == [1.0, 1.0]


def test_guard_names_the_reward_scaling_for_non_finite_advantages() -> None:
    from grpo_plugins.config import GRPOConfig

    guard = RunGuard(GRPOConfig(scale_rewards="batch"), ["acc"])
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [2.0]])  # NaN = not applicable: fine
    assert guard.check_rollout(rewards, torch.tensor([0.5, 0.0, -0.5, 1.0]), step=7) is None
    with pytest.raises(NonFiniteError, match="non-finite advantage at optimizer step 7, produced by reward scaling 'batch'"):
        guard.check_rollout(rewards, torch.tensor([0.5, float("nan"), -0.5, 1.0]), step=7)
    skip = RunGuard(GRPOConfig(on_nonfinite="skip"), ["acc"])
    assert skip.check_rollout(rewards, torch.tensor([float("inf")] * 4), step=2) == "reward scaling 'group'"
    assert skip.check_update(2, 0.1, 1.0, rollout_problem="reward scaling 'group'") is True
    assert skip.skipped == [(2, "reward scaling 'group'")]
    # float16: overflowing gradients with a finite loss are the gradient scaler's to handle.
    assert guard.check_update(3, 0.5, float("inf"), loss_scaling=True) is False
    with pytest.raises(NonFiniteError, match="optimizer step 3, produced by the backward pass"):
        guard.check_update(3, 0.5, float("inf"), [("w", torch.tensor([float("nan")]))])


# -- checkpoints that are not complete ---------------------------------------------------------------


def _fake_checkpoint(root: Path, name: str, state: str | None) -> Path:
    path = root / "checkpoints" / name
    (path / "model").mkdir(parents=True)
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_resume_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    good = _fake_checkpoint(tmp_path, "checkpoint-4", json.dumps({"global_step": 4}))
    _fake_checkpoint(tmp_path, "checkpoint-10", None)  # no completion marker
    _fake_checkpoint(tmp_path, ".tmp-checkpoint-12", json.dumps({"global_step": 12}))  # never renamed
    _fake_checkpoint(tmp_path, "checkpoint-11", '{"global_step": 1')  # marker cut short
    assert latest_checkpoint(tmp_path) == good
    assert resolve_resume(True, tmp_path) == good


# -- the guard on its own ----------------------------------------------------------------------------


def test_phase_turns_oom_into_advice_and_leaves_other_errors_alone(tmp_path: Path) -> None:
    from grpo_plugins.config import GRPOConfig

    guard = RunGuard(GRPOConfig(gradient_checkpointing=True, lora={"r": 4}), ["acc"])
    guard.last_checkpoint = tmp_path / "checkpoint-7"
    with pytest.raises(DeviceOutOfMemoryError) as info:
        with guard.phase("training", 8):
            raise _oom()
    message = str(info.value)
    assert "training of optimizer step 8" in message and str(tmp_path / "checkpoint-7") in message
    assert "gradient_checkpointing" not in message and "lora (" not in message  # already on
    with pytest.raises(DeviceOutOfMemoryError, match="during log-probs"):
        with guard.phase("log-probs", 8):
            raise RuntimeError("MPS backend out of memory (MPS allocated: 1 GiB)")
    with pytest.raises(KeyError):  # not memory, not a plugin's code: unchanged
        with guard.phase("training", 8):
            raise KeyError("x")


def test_prompt_lengths_are_checked_for_every_row(tmp_path: Path) -> None:
    from grpo_plugins.data import DataError, PromptTooLongError
    from grpo_plugins.testing import build_tiny_tokenizer
    from transformers import AutoTokenizer

    from grpo_plugins.data import check_prompt_lengths

    tok = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok")))
    prompts = ["ab"] * 600 + ["x" * 30] + [[{"role": "user", "content": "y" * 50}]]
    with pytest.raises(PromptTooLongError) as info:
        check_prompt_lengths(tok, prompts, max_prompt_length=20, truncation="error")
    assert "2 prompt(s)" in str(info.value) and "rows 600 (30 tokens), 601" in str(info.value)
    check_prompt_lengths(tok, prompts, max_prompt_length=20, truncation="left")  # truncated later: fine
    check_prompt_lengths(tok, prompts, max_prompt_length=20, truncation="error", limit=600)  # only the first 600
    with pytest.raises(DataError, match="prompt 300 is empty"):
        check_prompt_lengths(tok, ["ab"] * 300 + [""], max_prompt_length=20, truncation="error")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 training needs CUDA")
def test_float16_skipped_steps_keep_the_gradient_scaler_working(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = {k: v.float().cpu() for k, v in _snapshot(model).items()}
    registry = get_registry()
    with registry.temporary("loss_type", "nan_loss", NaNLoss):
        cfg = _config(tiny_model, tmp_path, loss_type="nan_loss", dtype="float16", on_nonfinite="skip", max_steps=3)
        Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS, registry=registry).train()
    assert [r["nonfinite_skipped"] for r in read_metrics(tmp_path / "out")] == [1.0, 1.0, 1.0]
    assert all(torch.equal(before[k], v.detach().float().cpu()) for k, v in model.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 training needs CUDA")
def test_float16_logs_the_loss_scale_and_the_scalers_skipped_steps(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import grpo_plugins.run_parts as run_parts

    make = run_parts.make_accelerator

    def huge_initial_scale(*args: Any, **kwargs: Any) -> Any:
        acc, plan = make(*args, **kwargs)
        acc.scaler._init_scale = 2.0**40  # every scaled gradient overflows float16 at first
        return acc, plan

    monkeypatch.setattr(run_parts, "make_accelerator", huge_initial_scale)
    model, tok = _model(tiny_model)
    before = {k: v.float().cpu() for k, v in _snapshot(model).items()}
    cfg = _config(tiny_model, tmp_path, dtype="float16", max_steps=3)
    Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS).train()
    records = read_metrics(tmp_path / "out")
    assert [r["loss_scale"] for r in records] == [2.0**39, 2.0**38, 2.0**37]
    assert [r["scaler_skipped"] for r in records] == [1.0, 1.0, 1.0]
    assert all(torch.equal(before[k], v.detach().float().cpu()) for k, v in model.named_parameters())


def test_oom_advice_adds_offload_qlora_and_the_generators_settings(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.config import GRPOConfig
    from grpo_plugins.guards import out_of_memory_advice

    lora = GRPOConfig(**_config(tiny_model, tmp_path, gradient_checkpointing=True, lora={"r": 4}))
    keys = [a.split(" ")[0] for a in out_of_memory_advice(lora, "training", ["generator.params.x (1)"])]
    assert keys[:3] == ["train_chunk_rows", "train_pass_tokens", "activation_offload"]
    assert keys[-2:] == ["generator.params.x", "load_in_4bit"]
    offloaded = GRPOConfig(**_config(tiny_model, tmp_path, gradient_checkpointing=True, activation_offload=True))
    keys = [a.split(" ")[0] for a in out_of_memory_advice(offloaded, "training")]
    assert "activation_offload" not in keys and "load_in_4bit" not in keys  # already on; full fine-tuning
    keys = [a.split(" ")[0] for a in out_of_memory_advice(lora, "generation", ["generator.params.x (1)"])]
    assert keys == ["steps_per_generation", "max_completion_length", "per_device_train_batch_size",
                    "generator.params.x", "load_in_4bit"]

    guard = RunGuard(lora, ["r"], generator_advice=lambda phase: [f"generator.params.during_{phase} (1)"])
    with pytest.raises(DeviceOutOfMemoryError, match="generator.params.during_log-probs"):
        with guard.phase("log-probs", 3):
            raise _oom()

    def broken(phase: str) -> list[str]:
        raise RuntimeError("a plugin bug")

    with pytest.raises(DeviceOutOfMemoryError, match="activation_offload"):  # the run's own advice still comes
        with RunGuard(lora, ["r"], generator_advice=broken).phase("training", 3):
            raise _oom()
