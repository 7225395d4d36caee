"""Bad input through the command line: each mistake is one clear message and a non-zero exit,
never a traceback (issue 8). ``validate`` finds what it can without loading a model; ``train``
finds the rest before the first optimizer step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_plugins.cli import main

ROOT = Path(__file__).resolve().parents[1]


# Rewards named by import path in the configs below ("test_bad_input:<name>").
def char_count(completions: list[Any], **kwargs: Any) -> list[float]:
    """Length of each completion."""
    return [float(len(c)) for c in completions]


def needs_answer(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion contains the dataset's answer column."""
    return [float(a in c) for c, a in zip(completions, answer)]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, tiny_model: dict | str, **changes: Any) -> Path:
    data = tmp_path / "train.jsonl"
    if not data.exists():
        _write_jsonl(data, [{"prompt": p, "answer": "x"} for p in ["ab", "cd", "ef", "gh"]])
    config: dict[str, Any] = {
        "model": tiny_model,
        "task": None,
        "dataset": {"path": "json", "data_files": str(data)},
        "rewards": ["test_bad_input:char_count"],
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 4,
        "report_to": ["jsonl"],
    }
    for key, value in changes.items():
        if value is None and key in config:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, " ".join(err.split())  # rich may wrap long lines


def _fails(capsys: pytest.CaptureFixture[str], command: str, config: Path, *says: str) -> str:
    code, err = _run(capsys, command, str(config))
    assert code != 0, err
    assert "error: " in err, err  # after any progress bars of the loaders
    err = err[err.index("error: ") :]
    for text in says:
        assert text in err, (text, err)
    return err


# -- the config file ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "train"])
def test_malformed_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("loss_type: dapo\nrewards: [a, b\nbeta: 0.1\n")
    _fails(capsys, command, path, "not valid YAML", "line 3")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_config_that_is_not_a_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- loss_type\n- dapo\n")
    _fails(capsys, command, path, "must be a mapping")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"learning_rte": 1e-5}, ["learning_rte", "did you mean 'learning_rate'"]),
        ({"lora": {"rank": 8}}, ["lora.rank", "unknown key 'rank'", "allowed keys: bias, dtype, lora_alpha"]),
        ({"per_device_train_batch_size": "many"}, ["per_device_train_batch_size", "integer", "'many'"]),
        ({"rewards": "test_bad_input:char_count"}, ["rewards", "list"]),
        ({"top_p": 1.5}, ["top_p", "less than or equal to 1"]),
        ({"num_generations": 1}, ["num_generations", "at least 2"]),
        ({"learning_rate": -1.0}, ["learning_rate", "greater than 0"]),
        ({"epsilon": float("nan")}, ["epsilon", "finite number"]),
        ({"rewards": [{"name": "test_bad_input:char_count", "weight": float("inf")}]}, ["rewards.0.weight", "finite number"]),
        ({"per_device_train_batch_size": 3}, ["num_generations"]),  # 3 completions: no whole group of 4
    ],
    ids=["unknown-key", "unknown-nested-key", "wrong-type", "wrong-shape", "above-range", "below-minimum",
         "negative", "nan", "inf-weight", "batch-arithmetic"],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_invalid_settings_name_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict, command: str, changes: dict, says: list[str]
) -> None:
    _fails(capsys, command, _config(tmp_path, tiny_model, **changes), *says)


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, "train", tmp_path / "nope.yaml", "cannot read the config file", "nope.yaml")


# -- the model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "train"])
def test_model_path_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    missing = str(tmp_path / "no" / "such-model")
    _fails(capsys, command, _config(tmp_path, missing), "model", "no such file or directory", missing)


def test_model_name_neither_local_nor_cached_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Looks like a hub id, so only loading can tell; the message says why nothing is downloaded.
    _fails(capsys, "train", _config(tmp_path, "acme/not-a-cached-model"), "acme/not-a-cached-model", "no hub access")


def _tokenizer_without(tiny_model: dict, tmp_path: Path, *tokens: str) -> dict:
    source = Path(tiny_model["tokenizer"])
    target = tmp_path / "tokenizer"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    settings = json.loads((target / "tokenizer_config.json").read_text())
    for token in tokens:
        settings.pop(token, None)
    (target / "tokenizer_config.json").write_text(json.dumps(settings))
    return {**tiny_model, "tokenizer": str(target)}


def test_tokenizer_without_pad_or_eos_token(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict) -> None:
    model = _tokenizer_without(tiny_model, tmp_path, "pad_token", "eos_token")
    _fails(capsys, "train", _config(tmp_path, model), "tokenizer", "neither a pad token nor an EOS token")


def test_tokenizer_without_pad_token_pads_with_eos(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict, caplog: pytest.LogCaptureFixture
) -> None:
    model = _tokenizer_without(tiny_model, tmp_path, "pad_token")
    code, err = _run(capsys, "train", str(_config(tmp_path, model)))
    assert code == 0, err
    assert "no pad token; using its EOS token" in caplog.text


# -- the data ----------------------------------------------------------------------------------


def test_empty_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = _config(tmp_path, tiny_model, dataset={"path": "json", "data_files": str(empty)})
    _fails(capsys, "train", config, "empty")


def test_dataset_file_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict) -> None:
    config = _config(tmp_path, tiny_model, dataset={"path": "json", "data_files": str(tmp_path / "gone.jsonl")})
    _fails(capsys, "validate", config, "dataset.data_files", "no such file")


def test_dataset_without_the_prompt_column(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict) -> None:
    data = _write_jsonl(tmp_path / "q.jsonl", [{"question": "ab"}] * 4)
    config = _config(tmp_path, tiny_model, dataset={"path": "json", "data_files": str(data)})
    _fails(capsys, "train", config, "no column 'prompt'", "question", "prompt_column")


def test_prompts_longer_than_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict) -> None:
    # The long prompt is the last row; it is still found before any training.
    rows = [{"prompt": "ab"}] * 7 + [{"prompt": "x" * 40}]
    data = _write_jsonl(tmp_path / "long.jsonl", rows)
    config = _config(tmp_path, tiny_model, dataset={"path": "json", "data_files": str(data)}, max_prompt_length=8)
    _fails(capsys, "train", config, "max_prompt_length=8", "40 tokens", "prompt_truncation: left")
    assert not (tmp_path / "out" / "checkpoints").exists()


# -- a reward's dataset columns ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "saved", "jsonl-as-path", "csv-as-path"])
def test_reward_argument_missing_from_the_dataset_is_found_by_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict, fmt: str
) -> None:
    rows = [{"prompt": "ab", "solution": "x"}, {"prompt": "cd", "solution": "y"}]
    if fmt == "jsonl":
        dataset = {"path": "json", "data_files": str(_write_jsonl(tmp_path / "d.jsonl", rows))}
    elif fmt == "jsonl-as-path":  # dataset.path naming the file itself
        dataset = {"path": str(_write_jsonl(tmp_path / "d.jsonl", rows))}
    elif fmt == "csv-as-path":
        (tmp_path / "d.csv").write_text("prompt,solution\nab,x\ncd,y\n")
        dataset = {"path": str(tmp_path / "d.csv")}
    elif fmt == "json":
        (tmp_path / "d.json").write_text(json.dumps(rows))
        dataset = {"path": "json", "data_files": str(tmp_path / "d.json")}
    elif fmt == "csv":
        (tmp_path / "d.csv").write_text("prompt,solution\nab,x\ncd,y\n")
        dataset = {"path": "csv", "data_files": str(tmp_path / "d.csv")}
    else:
        import datasets

        ds = datasets.Dataset.from_list(rows)
        if fmt == "parquet":
            ds.to_parquet(str(tmp_path / "d.parquet"))
            dataset = {"path": "parquet", "data_files": str(tmp_path / "d.parquet")}
        else:
            ds.save_to_disk(str(tmp_path / "saved"))
            dataset = {"path": str(tmp_path / "saved")}
    rewards = ["test_bad_input:char_count", "test_bad_input:needs_answer"]
    config = _config(tmp_path, tiny_model, dataset=dataset, rewards=rewards)
    _fails(capsys, "validate", config, "rewards.1", "needs_answer", "'answer'", "prompt, solution")


def test_reward_argument_present_in_the_dataset_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: dict
) -> None:
    config = _config(tmp_path, tiny_model, rewards=["test_bad_input:needs_answer"])
    code, err = _run(capsys, "validate", str(config))
    assert code == 0, err


def test_required_arguments_of_functions_and_classes() -> None:
    from grpo_plugins.validation import required_arguments

    class Scorer:
        def __call__(self, prompts, completions, answer, *, level, bonus=0.0, **kwargs):  # noqa: ANN001
            return []

    assert required_arguments(needs_answer) == ["prompts", "completions", "answer"]
    assert required_arguments(Scorer) == ["prompts", "completions", "answer", "level"]
    assert required_arguments(char_count) == ["completions"]


# -- through a real process --------------------------------------------------------------------


def test_train_exits_non_zero_without_a_traceback_in_a_real_process(tmp_path: Path) -> None:
    config = _config(tmp_path, str(tmp_path / "missing-model"), rewards=["test_bad_input:char_count"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_plugins.cli", "train", str(config)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "no such file or directory" in result.stderr
