"""The training engine on tiny random models (CPU, seconds each)."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.batching import make_plan
from grpo_plugins.engine import Engine, NonFiniteError
from grpo_plugins.generators import GeneratorUnavailableError
from grpo_plugins.kinds import GenerationOutput, Generator, LossType
from grpo_plugins.metrics import read_metrics
from grpo_plugins.models import load_model
from grpo_plugins.registry import get_registry
from grpo_plugins.rewards import RewardError

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]

#: Metrics every logged step carries (SPEC §6).
REQUIRED = [
    "reward", "reward_std", "frac_reward_zero_std", "entropy", "loss", "grad_norm", "learning_rate",
    "num_tokens", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "timing/generate",
    "timing/reward", "timing/train", "tokens_per_second", "peak_memory_gb",
]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that almost surely differs within a group: sum of character codes mod 7."""
    return [float(sum(map(ord, _text(c))) % 7) for c in completions]


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def _config(tiny_model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": tiny_model,
        "task": None,
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "seed": 0,
    }
    base.update(overrides)
    return base


def _model(tiny_model: dict, **kwargs: Any) -> tuple[Any, Any]:
    return load_model(tiny_model, dtype="float32", seed=0, **kwargs)


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _changed(before: dict[str, torch.Tensor], model: Any) -> bool:
    return any(not torch.equal(before[k], v.detach()) for k, v in model.named_parameters())


def _assert_finite_metrics(records: list[dict[str, Any]]) -> None:
    assert records
    for rec in records:
        for key in REQUIRED:
            assert key in rec, key
        for key, value in rec.items():
            assert math.isfinite(value), (key, value)


# -- every built-in loss type and IS level ----------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "grpo"},
        {"loss_type": "dr_grpo"},
        {"loss_type": "dapo"},
        {"loss_type": "bnpo"},
        {"loss_type": "cispo"},
        {"loss_type": "sapo"},
        {"loss_type": "dapo", "importance_sampling_level": "sequence"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.5},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_each_loss_type_and_is_level_trains(tiny_model: dict, tmp_path: Path, settings: dict) -> None:
    # GA 1 with 2 micro-steps per generation: the second step is off-policy (old log-probs used).
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    cfg = _config(tiny_model, tmp_path, **settings)
    result = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS).train()
    assert result.global_step == 2
    assert _changed(before, model)
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2]
    _assert_finite_metrics(records)
    assert "rewards/char_sum/mean" in records[0]


@pytest.mark.parametrize(("steps_per_generation", "beta", "passes"), [(2, 0.0, True), (1, 0.0, False), (1, 0.1, True)])
def test_the_log_prob_passes_are_timed_on_the_step_after_their_rollout(
    tiny_model: dict, tmp_path: Path, steps_per_generation: int, beta: float, passes: bool
) -> None:
    # Old log-probs run when a cycle has an off-policy step, reference ones when beta != 0; the
    # first step after a rollout carries their seconds (like generation's), the others carry 0.
    model, tok = _model(tiny_model)
    cfg = _config(tiny_model, tmp_path, steps_per_generation=steps_per_generation, beta=beta)
    Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS).train()
    records = read_metrics(tmp_path / "out")
    seconds = [r["timing/logprobs"] for r in records]
    generated = [r["timing/generate"] > 0 for r in records]
    assert generated == ([True, False] if steps_per_generation == 2 else [True, True])
    assert all((s > 0) == (passes and g) for s, g in zip(seconds, generated)), seconds
    assert all(r["timing/logprobs"] + r["timing/generate"] + r["timing/train"] <= r["timing/step"] for r in records)


def test_an_earlier_accelerator_with_other_settings_does_not_block_a_run(tiny_model: dict, tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # whatever earlier tests left
    Accelerator(cpu=True, mixed_precision="bf16")  # e.g. left by a benchmark or a notebook cell
    model, tok = _model(tiny_model)
    result = Engine(_config(tiny_model, tmp_path), model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS).train()
    assert result.global_step == 2
    assert result.metrics and math.isfinite(result.metrics["loss"])


def test_every_engine_attribute_is_declared_in_init_and_setup_adds_only_the_built_parts(
    tiny_model: dict, tmp_path: Path
) -> None:
    from grpo_plugins.run_parts import RunParts

    model, tok = _model(tiny_model)
    engine = Engine(_config(tiny_model, tmp_path), model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    declared = set(vars(engine))
    with pytest.raises(AttributeError, match="before setup"):
        engine.optimizer
    engine.train()
    assert set(vars(engine)) == declared | {"parts"}
    assert isinstance(engine.parts, RunParts) and engine.optimizer is engine.parts.policy.optimizer


def test_kl_rollout_correction_and_iterations(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    cfg = _config(
        tiny_model, tmp_path, beta=0.1, num_iterations=2, vllm_importance_sampling_correction=True, max_steps=4
    )
    engine = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    assert _changed(before, model)
    records = read_metrics(tmp_path / "out")
    _assert_finite_metrics(records)
    for key in ("kl", "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max"):
        assert key in records[-1]
    assert records[-1]["kl"] > 0  # the policy has moved away from the frozen reference
    assert engine.ref_model is not None  # full fine-tuning: a frozen copy


# -- the plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=3),
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, steps_per_generation=4, num_generations=4),
        dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, num_generations=3),
        dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=2, num_generations=4,
             num_iterations=2),
    ],
    ids=["seed-ex1", "seed-ex3", "seed-ex4", "mu2"],
)
def test_micro_batches_consumed_equal_the_plan(tiny_model: dict, tmp_path: Path, batch: dict) -> None:
    """What the generator, the rewards and the training forwards actually receive, mapped back to
    prompt indices, is what `plan` shows (not the engine's own trace of the plan)."""
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.prompts import PromptStream
    from grpo_plugins.testing import registered_component

    plan = make_plan(**batch)
    cycles = 2
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    texts = [row["prompt"] for row in PROMPTS]
    generated: list[list[str]] = []  # the prompts of each generate() call
    scored: list[list[str]] = []  # the prompts of each reward call
    trained: list[list[str]] = []  # the prompts of the rows of each training forward

    class Recording(TransformersGenerator):
        def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
            generated.append(tok.batch_decode(prompt_ids, skip_special_tokens=True))
            return super().generate(prompt_ids)

    def recording_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        scored.append(list(prompts))
        return char_sum(completions)

    def record_forward(module: Any, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # a training forward, not an old/ref log-prob pass
            rows = tok.batch_decode(kwargs["input_ids"], skip_special_tokens=True)
            trained.append([row[:2] for row in rows])  # every prompt is 2 characters

    model.get_decoder().register_forward_pre_hook(record_forward, with_kwargs=True)
    cfg = _config(tiny_model, tmp_path, **batch, max_steps=cycles * plan.optimizer_steps_per_generation,
                  max_completion_length=3, generator="recording")
    with registered_component("generator", Recording, "recording"):
        Engine(cfg, model=model, tokenizer=tok, rewards=[recording_reward], dataset=PROMPTS).train()

    stream = PromptStream(len(PROMPTS), seed=0)  # the run's seed

    def prompts_of(indices: list[int]) -> list[str]:
        return [texts[stream.row(i)] for i in indices]

    expected_cycles = [prompts_of(plan.prompt_indices(c)) for c in range(cycles)]
    assert generated == expected_cycles
    assert scored == expected_cycles
    assert trained == [prompts_of(list(s.batch)) for c in range(cycles) for s in plan.cycle(c)]


# -- LoRA and the reference model ---------------------------------------------------------------


def _alive_models(cls: type) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


def test_lora_with_beta_keeps_a_single_base_copy(tiny_model: dict, tmp_path: Path) -> None:
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    from transformers import LlamaForCausalLM

    cfg = _config(tiny_model, tmp_path, beta=0.1, lora=lora, max_steps=3, learning_rate=5e-2)
    before = _alive_models(LlamaForCausalLM)  # other tests' models may not be collected yet
    engine = Engine(cfg, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    assert type(engine.unwrapped.get_base_model()) is LlamaForCausalLM
    assert engine.ref_model is None
    assert _alive_models(LlamaForCausalLM) == before + 1  # no second copy of the base model
    storages = {p.untyped_storage().data_ptr() for p in engine.unwrapped.parameters()}
    assert len(storages) == len(list(engine.unwrapped.parameters()))
    assert all("lora_" in n for n, p in engine.unwrapped.named_parameters() if p.requires_grad)
    records = read_metrics(tmp_path / "out")
    _assert_finite_metrics(records)
    assert records[-1]["kl"] > 0  # adapter on vs. off differ after the first updates
    # The checkpoint holds the adapter only.
    model_dir = engine.output_dir / "checkpoints" / "checkpoint-3" / "model"
    files = {p.name for p in model_dir.iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files


# -- truncation masking -------------------------------------------------------------------------


class NoEOSGenerator(Generator):
    """Test stand-in: fixed completions of max_completion_length tokens, none with an EOS."""

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        n, t = len(prompt_ids), self.sampling.max_completion_length
        ids = torch.tensor([[10 + (i * 7 + j * 3) % 50 for j in range(t)] for i in range(n)])
        return GenerationOutput(
            completion_ids=ids, completion_mask=torch.ones(n, t, dtype=torch.long),
            is_truncated=torch.ones(n, dtype=torch.bool),
        )


def test_all_truncated_with_masking_leaves_parameters_and_logs_no_nan(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    registry = get_registry()
    cfg = _config(tiny_model, tmp_path, mask_truncated_completions=True, generator="no_eos_test", beta=0.1,
                  max_steps=3)
    with registry.temporary("generator", "no_eos_test", NoEOSGenerator):
        Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS, registry=registry).train()
    assert not _changed(before, model)
    records = read_metrics(tmp_path / "out")
    _assert_finite_metrics(records)
    assert all(r["completions/clipped_ratio"] == 1.0 and r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in records)


# -- a tiny toy task learns ---------------------------------------------------------------------


def count_a(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(c.count("a")) for c in completions]


@pytest.mark.slow
def test_tiny_model_learns_a_token_count_reward(tiny_model: dict, tmp_path: Path) -> None:
    cfg = _config(
        tiny_model, tmp_path, max_steps=50, per_device_train_batch_size=16, steps_per_generation=1,
        num_generations=8, max_completion_length=8, learning_rate=3e-3, lr_scheduler_type="constant",
        loss_type="dapo",
    )
    Engine(cfg, rewards=[count_a], dataset=PROMPTS).train()
    rewards = [r["reward"] for r in read_metrics(tmp_path / "out")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # From ~0.1 'a' per 8-token completion to several (about 5-7 over seeds 0-4).
    assert last > first + 2.0, rewards


# -- reward contracts ---------------------------------------------------------------------------


def reward_len(completions, **kwargs):  # noqa: ANN001, ANN201 - exactly as TRL's docs write it
    return [-abs(20 - len(completion)) for completion in completions]


def only_with_digit(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [None if i % 2 else 1.0 for i, _ in enumerate(completions)]


async def async_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [float(len(ids) % 3) for ids in completion_ids]


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_trl_none_and_async_rewards_in_a_run(tiny_model: dict, tmp_path: Path, conversational: bool) -> None:
    seen: list[Any] = []

    def with_column(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        seen.extend(completions)
        return [float(a == "x") for a in answer]

    data = [
        {"prompt": [{"role": "user", "content": p["prompt"]}] if conversational else p["prompt"], "answer": "x"}
        for p in PROMPTS
    ]
    cfg = _config(tiny_model, tmp_path, log_completions=True)
    if conversational:
        def reward_len(completions, **kwargs):  # noqa: ANN001, ANN202 - TRL's conversational example
            return [-abs(20 - len(c[0]["content"])) for c in completions]
    else:
        reward_len = globals()["reward_len"]
    Engine(cfg, rewards=[reward_len, only_with_digit, async_reward, with_column], dataset=data).train()
    records = read_metrics(tmp_path / "out")
    _assert_finite_metrics(records)
    for name in ("reward_len", "only_with_digit", "async_reward", "with_column"):
        assert f"rewards/{name}/mean" in records[0]
    assert records[0]["rewards/only_with_digit/mean"] == 1.0  # None rows skipped, not zero
    assert records[0]["rewards/with_column/mean"] == 1.0
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in seen) == conversational
    lines = (tmp_path / "out" / "completions.jsonl").read_text().splitlines()
    assert len(lines) == 8 and "advantage" in json.loads(lines[0])  # one cycle of 2 x 4 completions


# -- failures -----------------------------------------------------------------------------------


def test_reward_failure_saves_last_step_and_stops(tiny_model: dict, tmp_path: Path) -> None:
    calls = []

    def flaky(completions: list[Any], **kwargs: Any) -> list[float]:
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")
        return char_sum(completions)

    cfg = _config(tiny_model, tmp_path, max_steps=10, save_steps=100)
    with pytest.raises(RewardError, match="flaky"):
        Engine(cfg, rewards=[flaky], dataset=PROMPTS).train()
    # Two cycles of 2 optimizer steps completed before the third scoring failed.
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-4"]
    state = json.loads((tmp_path / "out" / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["cycle"] == 2 and not state["mid_cycle"]


class NaNLoss(LossType):
    """Test stand-in: a loss type whose loss is NaN."""

    def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
        return (per_token_loss * inputs.mask).sum() * float("nan")


def test_nonfinite_loss_stops_with_the_step_number(tiny_model: dict, tmp_path: Path) -> None:
    registry = get_registry()
    with registry.temporary("loss_type", "nan_test", NaNLoss):
        cfg = _config(tiny_model, tmp_path, loss_type="nan_test")
        with pytest.raises(NonFiniteError, match="optimizer step 1"):
            Engine(cfg, rewards=[char_sum], dataset=PROMPTS, registry=registry).train()


def test_nonfinite_loss_skip_leaves_parameters(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    before = _snapshot(model)
    registry = get_registry()
    with registry.temporary("loss_type", "nan_test", NaNLoss):
        cfg = _config(tiny_model, tmp_path, loss_type="nan_test", on_nonfinite="skip")
        Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS, registry=registry).train()
    assert not _changed(before, model)
    records = read_metrics(tmp_path / "out")
    assert [r["nonfinite_skipped"] for r in records] == [1.0, 1.0]
    _assert_finite_metrics(records)


def test_fast_inference_without_vllm_is_a_clear_error(tiny_model: dict, tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed")
    except ImportError:
        pass
    with pytest.raises(GeneratorUnavailableError, match="fast_inference"):
        Engine(_config(tiny_model, tmp_path, fast_inference=True), rewards=[char_sum], dataset=PROMPTS).train()


def test_python_path_applies_lora_to_a_plain_model(tiny_model: dict, tmp_path: Path) -> None:
    model, tok = _model(tiny_model)
    cfg = _config(tiny_model, tmp_path, lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    engine = Engine(cfg, model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    result = engine.train()
    assert hasattr(engine.unwrapped, "peft_config")
    assert (result.checkpoint / "model" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_cli_reward_failure_exits_nonzero_after_saving(tiny_model: dict, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import yaml

    (tmp_path / "failing_rewards.py").write_text(
        "calls = []\n"
        "def flaky(completions, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        raise RuntimeError('scorer crashed')\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    cfg = _config(tiny_model, tmp_path, max_steps=6, dataset={"path": "json", "data_files": str(tmp_path / "train.jsonl")},
                  rewards=["failing_rewards:flaky"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "grpo_plugins.cli", "train", str(tmp_path / "run.yaml")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "flaky" in run.stderr and "scorer crashed" in run.stderr and "Traceback" not in run.stderr
    saved = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    assert (saved / "trainer_state.json").is_file()  # the first cycle's 2 steps were saved


# -- an earlier run in output_dir -----------------------------------------------------------------


def test_a_fresh_run_into_an_earlier_runs_folder_is_refused_before_loading(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With save_total_limit 1, a fresh run there used to rotate its own checkpoint away, keep the
    earlier run's, and overwrite its metrics. Now it stops with one message, before the model
    loads, and leaves the earlier run as it was; --resume continues that run."""
    from grpo_plugins.checkpoint import CheckpointError, list_checkpoints

    cfg = _config(tiny_model, tmp_path, max_steps=3, save_steps=3, save_total_limit=1)
    Engine(cfg, rewards=[char_sum], dataset=PROMPTS).train()
    out = tmp_path / "out"
    metrics_before = (out / "metrics.jsonl").read_bytes()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]

    def no_loading(self: Engine) -> None:
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patch:
        patch.setattr(Engine, "_setup", no_loading)
        with pytest.raises(CheckpointError, match=r"already holds an earlier run \(checkpoints/checkpoint-3, metrics.jsonl\).*--resume"):
            Engine({**cfg, "max_steps": 1, "save_steps": 1}, rewards=[char_sum], dataset=PROMPTS).train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    assert (out / "metrics.jsonl").read_bytes() == metrics_before

    # Metrics alone (a run that never saved) count too; an empty metrics file does not.
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    result = Engine({**cfg, "output_dir": str(other), "max_steps": 1, "save_steps": 100}, rewards=[char_sum], dataset=PROMPTS).train()
    assert result.global_step == 1
    shutil.rmtree(other / "checkpoints")  # the run's final save
    with pytest.raises(CheckpointError, match=r"\(metrics.jsonl\)"):
        Engine({**cfg, "output_dir": str(other), "max_steps": 1}, rewards=[char_sum], dataset=PROMPTS).train()

    resumed = Engine({**cfg, "max_steps": 4}, rewards=[char_sum], dataset=PROMPTS).train(resume=True)
    assert resumed.global_step == 4
