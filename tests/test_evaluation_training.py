"""Evaluation during training (eval_strategy: steps) and `grpo-plugins eval`: the eval metrics are
logged, evaluating does not change what the run trains, a resumed run evaluates as an
uninterrupted one, a LoRA checkpoint evaluates to the numbers the run logged, and CLI mistakes are
one clear line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.cli import main
from grpo_plugins.engine import Engine
from grpo_plugins.metrics import read_metrics

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]
EVAL_PROMPTS = [{"prompt": p} for p in ["qr", "st", "uv"]]
#: Metrics that measure time or memory differ between runs; everything else must be equal.
VOLATILE = ("timing/", "tokens_per_second", "peak_memory_gb", "eval/seconds")


def char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def even_length(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]


def _config(tiny_model: dict, output_dir: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "steps_per_generation": 2,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 5e-2,
        "report_to": ["jsonl"],
        "save_total_limit": None,
        "seed": 3,
        "per_device_eval_batch_size": 6,
        "num_generations_eval": 3,
        **extra,
    }


def _stable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model" / "model.safetensors"))


def _train(config: dict[str, Any], resume: Any = None) -> Any:
    return Engine(config, rewards=[char_sum, even_length], dataset=PROMPTS, eval_dataset=EVAL_PROMPTS).train(resume=resume)


def test_training_with_evaluation_trains_exactly_as_without(tiny_model: dict, tmp_path: Path) -> None:
    plain = _train(_config(tiny_model, tmp_path / "plain"))
    evaluated = _train(
        _config(tiny_model, tmp_path / "eval", eval_strategy="steps", eval_steps=2, eval_on_start=True)
    )
    a, b = _weights(plain.checkpoint), _weights(evaluated.checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _stable(plain.history) == _stable(evaluated.history)

    assert [e["step"] for e in evaluated.evals] == [0, 2, 4]
    assert evaluated.evals[0]["eval/num_prompts"] == 3.0
    assert "eval/rewards/even_length/pass@3" in evaluated.evals[0]  # 0/1 reward: pass@k
    assert "eval/rewards/char_sum/pass@1" not in evaluated.evals[0]
    records = read_metrics(tmp_path / "eval")
    assert [r for r in records if "eval/reward" in r] == evaluated.evals
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4]


def test_a_resumed_run_evaluates_and_trains_as_an_uninterrupted_one(tiny_model: dict, tmp_path: Path) -> None:
    settings = dict(eval_strategy="steps", eval_steps=2, save_steps=2, steps_per_generation=4, gradient_accumulation_steps=2)
    straight = _train(_config(tiny_model, tmp_path / "straight", **settings))
    # Cut the run after its step-2 checkpoint (saved inside a generation cycle) and resume it.
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "checkpoint-4")
    resumed = _train(_config(tiny_model, tmp_path / "resumed", **settings), resume=True)

    a, b = _weights(straight.checkpoint), _weights(resumed.checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [e["step"] for e in resumed.evals] == [4]
    assert _stable(resumed.evals) == _stable(straight.evals[1:])
    assert _stable(read_metrics(tmp_path / "resumed")) == _stable(read_metrics(tmp_path / "straight"))


@pytest.mark.parametrize("lora", [{"r": 4, "lora_alpha": 8}, None], ids=["lora", "full"])
def test_eval_of_a_checkpoint_gives_the_numbers_the_run_logged(
    tiny_model: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], lora: dict | None
) -> None:
    import yaml

    eval_file, train_file = tmp_path / "eval.jsonl", tmp_path / "train.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in EVAL_PROMPTS))
    train_file.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    config = _config(
        tiny_model, tmp_path / "run", lora=lora, max_steps=2, eval_strategy="steps",
        eval_steps=2, rewards=["test_evaluation_training:char_sum", "test_evaluation_training:even_length"],
        dataset={"path": str(train_file)}, eval_dataset={"path": str(eval_file)}, learning_rate=0.2,
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    logged = Engine(config).train().evals[-1]
    capsys.readouterr()

    assert main(["eval", str(config_file), "--json"]) == 0  # the newest checkpoint of output_dir
    report = json.loads(capsys.readouterr().out)
    assert report["model"].endswith("checkpoint-2")
    assert _stable([report["metrics"]]) == _stable([{k: v for k, v in logged.items() if k != "step"}])

    assert main(["eval", str(config_file), "--base", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert base["model"] == "base"
    assert base["metrics"] != report["metrics"]  # training changed what the model samples


def _cli_config(tiny_model: dict, tmp_path: Path, **extra: Any) -> Path:
    import yaml

    config = {
        "model": tiny_model,
        "task": {"name": "arithmetic", "params": {"num_eval_samples": 4}},
        "max_prompt_length": 400,
        "max_completion_length": 4,
        "num_generations": 3,
        "per_device_train_batch_size": 3,
        "output_dir": str(tmp_path / "out"),
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_eval_base_on_the_arithmetic_held_out_split_prints_a_table(
    tiny_model: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(_cli_config(tiny_model, tmp_path)), "--base"]) == 0
    out = capsys.readouterr().out
    assert "eval of base: 4 prompts x 3 samples" in out
    for column in ("correct_answer", "format", "weighted", "pass@1", "pass@3", "greedy"):
        assert column in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint", "{tmp}/missing"], "--checkpoint '{tmp}/missing' does not exist"),
        (["--checkpoint", "{tmp}"], "is not a checkpoint (no trainer_state.json), a run directory"),
        ([], "no checkpoint in {tmp}/out/checkpoints (the config's output_dir); train first"),
        (["--base", "--set", "dataset.path={tmp}/x.jsonl"], "training uses dataset:, so no task's held-out split applies; set eval_dataset"),
    ],
)
def test_eval_mistakes_are_one_clear_line_and_exit_2(
    tiny_model: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    config = _cli_config(tiny_model, tmp_path)
    (tmp_path / "x.jsonl").write_text('{"prompt": "ab"}\n')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["eval", str(config), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert message.replace("{tmp}", str(tmp_path)) in err


def test_eval_takes_checkpoint_or_base_not_both(tiny_model: dict, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(_cli_config(tiny_model, tmp_path)), "--base", "--checkpoint", str(tmp_path)])
    assert exit_info.value.code == 2


def fails_on_eval_prompts(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    if any(p in {r["prompt"] for r in EVAL_PROMPTS} for p in prompts):
        raise ValueError("no score for eval prompts")
    return [0.0] * len(completions)


def test_a_reward_failing_while_evaluating_stops_the_run_after_saving_the_step(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.checkpoint import latest_checkpoint
    from grpo_plugins.rewards import RewardError

    config = _config(tiny_model, tmp_path / "run", eval_strategy="steps", eval_steps=1, steps_per_generation=4, gradient_accumulation_steps=2)
    engine = Engine(config, rewards=[char_sum, fails_on_eval_prompts], dataset=PROMPTS, eval_dataset=EVAL_PROMPTS)
    with pytest.raises(RewardError, match="fails_on_eval_prompts.*no score for eval prompts"):
        engine.train()
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-1"  # saved inside the cycle
    assert engine.evals == []
