"""generate_ahead: the next batch is generated in a thread beside this batch's training pass,
from the weights before this cycle's optimizer step; corrected like any off-policy sampler;
reproducible; and resumed exactly from a checkpoint that holds the pending generation."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(tiny_model: dict, output_dir: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 4,
        "save_steps": 2,
        "save_total_limit": None,
        "logging_steps": 1,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 5e-2,
        "lr_scheduler_type": "constant",
        "report_to": ["jsonl"],
        "seed": 3,
        "generate_ahead": True,
        # Merged copies (the default on a GPU): the decode then runs none of the model's modules.
        "generator": {"name": "static", "params": {"merge_weights": True}},
        **overrides,
    }


def _weights(model: Any) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


class Recorder:
    """Wraps a run's static decoder: for each generation, the thread it ran in and the weights
    it saw at its start and end; and the weights after each optimizer step."""

    def __init__(self, engine: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self.after_steps: list[torch.Tensor] = []
        setup, record = engine._setup, self

        def wrapped_setup() -> None:
            setup()
            model = engine.parts.policy.unwrapped
            decoder = engine.parts.generator._decoder
            generate = decoder.generate

            def generate_recorded(prompt_ids: list[list[int]]) -> Any:
                before = _weights(model)
                out = generate(prompt_ids)
                record.calls.append({"thread": threading.current_thread().name, "before": before, "after": _weights(model)})
                return out

            decoder.generate = generate_recorded
            step = engine._optimizer_step

            def step_recorded(*args: Any, **kwargs: Any) -> Any:
                out = step(*args, **kwargs)
                record.after_steps.append(_weights(model))
                return out

            engine._optimizer_step = step_recorded

        engine._setup = wrapped_setup


def test_the_next_batch_is_sampled_beside_training_from_the_weights_before_the_step(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.engine import Engine
    from grpo_plugins.metrics import read_metrics

    engine = Engine(_config(tiny_model, tmp_path / "run", save_steps=100), rewards=[char_sum], dataset=PROMPTS)
    record = Recorder(engine)
    initial = None

    def keep_initial() -> None:
        nonlocal initial
        initial = _weights(engine.parts.policy.unwrapped)

    setup = engine._setup
    engine._setup = lambda: (setup(), keep_initial())  # type: ignore[method-assign]
    engine.train()

    # Cycle 0 is generated before anything trains; cycles 1-3 each beside the cycle before (none
    # after the last step).
    threads = [c["thread"] for c in record.calls]
    assert len(threads) == 4
    assert threads[0] == threading.current_thread().name
    assert all(t.startswith("generate-ahead") for t in threads[1:]), threads
    # Cycle k+1 saw the weights cycle k trained from (one optimizer step older than the ones it
    # trains), unchanged while it ran.
    seen = [initial, initial, *record.after_steps]
    for k, call in enumerate(record.calls):
        assert torch.equal(call["before"], seen[k]), k
        assert torch.equal(call["after"], seen[k]), k
    assert not torch.equal(seen[2], seen[1])  # the steps did move the weights
    # The samples are one step old: the run keeps the sampler's log-probs and corrects for them.
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all("sampling/importance_sampling_ratio/mean" in m for m in metrics), sorted(metrics[-1])


def test_a_run_ahead_repeats_itself_and_resumes_exactly(tiny_model: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from grpo_plugins.engine import Engine
    from grpo_plugins.metrics import read_metrics

    def final(run: Path, step: int = 4) -> dict[str, torch.Tensor]:
        return load_file(str(run / "checkpoints" / f"checkpoint-{step}" / "model" / "model.safetensors"))

    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        Engine(_config(tiny_model, run), rewards=[char_sum], dataset=PROMPTS).train()
    wa, wb = final(a), final(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # checkpoint-2 holds the generation of cycle 2, made beside cycle 1 from step 1's weights.
    assert (a / "checkpoints" / "checkpoint-2" / "ahead_0.pt").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(a, resumed)
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-4")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in (a / "metrics.jsonl").read_text().splitlines()[:2]))
    Engine(_config(tiny_model, resumed), rewards=[char_sum], dataset=PROMPTS).train(resume=True)
    wr = final(resumed)
    assert all(torch.equal(wa[k], wr[k]) for k in wa)

    stable = lambda ms: [{k: v for k, v in m.items() if not k.startswith(("timing/", "tokens_per_second", "peak_memory"))} for m in ms]  # noqa: E731
    assert stable(read_metrics(resumed)) == stable(read_metrics(a))


def test_without_the_pending_generation_a_resume_samples_anew(tiny_model: dict, tmp_path: Path) -> None:
    """The check above can fail: resuming from a checkpoint whose pending generation is removed
    samples cycle 2 from step 2's weights, and the run ends elsewhere."""
    from safetensors.torch import load_file

    from grpo_plugins.engine import Engine

    a = tmp_path / "a"
    Engine(_config(tiny_model, a), rewards=[char_sum], dataset=PROMPTS).train()
    resumed = tmp_path / "resumed"
    shutil.copytree(a, resumed)
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-4")
    (resumed / "checkpoints" / "checkpoint-2" / "ahead_0.pt").unlink()
    Engine(_config(tiny_model, resumed), rewards=[char_sum], dataset=PROMPTS).train(resume=True)
    wa = load_file(str(a / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    wr = load_file(str(resumed / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    assert not all(torch.equal(wa[k], wr[k]) for k in wa)


def test_lora_dropout_is_refused_with_generate_ahead(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.config import load_config
    from grpo_plugins.config_errors import ConfigError

    config = _config(tiny_model, tmp_path / "run", lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.05})
    with pytest.raises(ConfigError, match="generate_ahead.*lora_dropout"):
        load_config(config)
    load_config({**config, "lora": {"r": 4, "lora_alpha": 8}})  # no dropout: accepted


def test_the_correction_counts_an_ahead_sampler_as_off_policy() -> None:
    from grpo_plugins.rollout import corrects_rollouts, keeps_sampling_logps

    class OwnPolicy:
        samples_from_policy = True

    assert not corrects_rollouts("auto", OwnPolicy())
    assert corrects_rollouts("auto", OwnPolicy(), ahead=True)
    assert keeps_sampling_logps("auto", OwnPolicy(), ahead=True)
    assert keeps_sampling_logps(False, OwnPolicy(), ahead=True)  # kept for the metrics, not corrected
    assert not corrects_rollouts(False, OwnPolicy(), ahead=True)


def test_the_training_pass_leaves_the_random_state_alone_while_the_next_batch_samples(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activation checkpointing (of the layers and of the log-prob chunks) would save and restore
    the random state around each recomputation, rewinding the stream the generation beside it
    draws from: with no dropout there is nothing to restore, and nothing does."""
    from grpo_plugins.engine import Engine

    window = {"open": False}
    touched: list[str] = []
    for module, name in [(torch, "set_rng_state"), (torch.random, "set_rng_state"), (torch, "manual_seed"), (torch.random, "manual_seed")]:
        original = getattr(module, name)

        def recorded(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if window["open"] and threading.current_thread() is threading.main_thread():
                touched.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    engine = Engine(_config(tiny_model, tmp_path / "run", save_steps=100, gradient_checkpointing=True), rewards=[char_sum], dataset=PROMPTS)
    setup = engine._setup

    def setup_with_window() -> None:
        setup()
        rollouts = engine.parts.rollouts
        start, wait = rollouts.start_ahead, rollouts.wait_ahead

        def start_open(*args: Any) -> None:
            start(*args)
            window["open"] = True

        def wait_closed() -> None:
            wait()
            window["open"] = False

        rollouts.start_ahead, rollouts.wait_ahead = start_open, wait_closed

    engine._setup = setup_with_window  # type: ignore[method-assign]
    engine.train()
    assert engine.parts.update.policy.unwrapped.is_gradient_checkpointing
    assert touched == []


def test_a_model_with_dropout_is_refused_and_checkpointing_keeps_its_random_state(tmp_path: Path) -> None:
    from grpo_plugins.dropout import dropout_in
    from grpo_plugins.engine import Engine
    from grpo_plugins.errors import GRPOPluginsError
    from grpo_plugins.models import load_model
    from grpo_plugins.testing import tiny_model_spec

    plain = tiny_model_spec(tmp_path / "plain", "llama")
    dropping = tiny_model_spec(tmp_path / "dropping", "llama", attention_dropout=0.1)
    assert dropout_in(load_model(plain)[0]) is None
    assert "attention_dropout" in dropout_in(load_model(dropping)[0])

    def preserves(model: Any) -> bool:
        funcs = [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None)]
        return funcs[0].keywords["preserve_rng_state"]

    assert not preserves(load_model(plain, gradient_checkpointing=True)[0])
    assert preserves(load_model(dropping, gradient_checkpointing=True)[0])

    with pytest.raises(GRPOPluginsError, match="generate_ahead.*attention_dropout"):
        Engine(_config(dropping, tmp_path / "run"), rewards=[char_sum], dataset=PROMPTS).train()
