"""load_prompts / encode_prompts: data sources, the prompt column, clear errors, chat templates,
max_prompt_length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_plugins.config import GRPOConfig
from grpo_plugins.data import DataError, PromptTooLongError, encode_prompts, left_pad, load_prompts
from grpo_plugins.kinds import Task
from grpo_plugins.registry import Registry

ROWS = [{"question": "1+1?", "answer": "2"}, {"question": "2+3?", "answer": "5"}]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry(entry_points=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from grpo_plugins.models import load_tokenizer
    from grpo_plugins.testing import build_tiny_tokenizer

    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def _config(**kw) -> GRPOConfig:
    return GRPOConfig(**{"task": None, **kw})


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- sources --------------------------------------------------------------------------------------


def test_jsonl_with_data_files_and_prompt_column_renamed(tmp_path: Path, registry: Registry) -> None:
    f = _jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = _config(dataset={"path": "json", "data_files": str(f), "prompt_column": "question"})
    dataset, task = load_prompts(cfg, registry)
    assert task is None
    assert dataset["prompt"] == ["1+1?", "2+3?"] and dataset["answer"] == ["2", "5"]
    assert "question" not in dataset.column_names


def test_a_file_path_alone_picks_its_reader(tmp_path: Path, registry: Registry) -> None:
    import datasets

    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]).to_csv(str(tmp_path / "p.csv"))
    datasets.Dataset.from_list([{"prompt": "c"}]).to_parquet(str(tmp_path / "p.parquet"))
    for name, expected in (("p.csv", ["a", "b"]), ("p.parquet", ["c"])):
        dataset, _ = load_prompts(_config(dataset={"path": str(tmp_path / name)}), registry)
        assert dataset["prompt"] == expected


def test_saved_dataset_directory_and_split(tmp_path: Path, registry: Registry) -> None:
    import datasets

    chat = [{"role": "user", "content": "hi"}]
    datasets.Dataset.from_list([{"prompt": chat, "k": 1}]).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": "t"}]), "test": datasets.Dataset.from_list([{"prompt": "e"}])}
    ).save_to_disk(str(tmp_path / "dict"))
    one, _ = load_prompts(_config(dataset={"path": str(tmp_path / "one")}), registry)
    assert one[0]["prompt"] == chat and one[0]["k"] == 1
    test, _ = load_prompts(_config(dataset={"path": str(tmp_path / "dict"), "split": "test"}), registry)
    assert test["prompt"] == ["e"]
    with pytest.raises(DataError, match="no split 'validation'.*dataset.split"):
        load_prompts(_config(dataset={"path": str(tmp_path / "dict"), "split": "validation"}), registry)


def test_task_supplies_the_data_and_a_dataset_overrides_it(tmp_path: Path, registry: Registry) -> None:
    import datasets

    class Toy(Task):
        """A toy task."""

        default_rewards = ["r"]

        def load(self, seed: int):
            return datasets.Dataset.from_list([{"prompt": f"seed {seed}"}])

    with registry.temporary("task", "toy", Toy):
        dataset, task = load_prompts(_config(task="toy", seed=9), registry)
        assert dataset["prompt"] == ["seed 9"] and isinstance(task, Toy)
        f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "from file"}])
        dataset, task = load_prompts(_config(task="toy", dataset={"path": str(f)}), registry)
        assert dataset["prompt"] == ["from file"] and isinstance(task, Toy)


# -- errors ---------------------------------------------------------------------------------------


def test_missing_file_is_named(tmp_path: Path, registry: Registry) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="nope.jsonl' does not exist"):
        load_prompts(_config(dataset={"path": "json", "data_files": missing}), registry)
    with pytest.raises(DataError, match="no file matches"):
        load_prompts(_config(dataset={"path": "json", "data_files": str(tmp_path / "*.jsonl")}), registry)
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(_config(dataset={"path": str(tmp_path / "dir" / "x")}), registry)
    with pytest.raises(DataError, match="needs dataset.data_files"):
        load_prompts(_config(dataset={"path": "json"}), registry)


def test_missing_prompt_column_lists_the_columns(tmp_path: Path, registry: Registry) -> None:
    f = _jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match="no column 'prompt'.*prompt_column.*question, answer"):
        load_prompts(_config(dataset={"path": str(f)}), registry)


def test_prompt_column_clash_and_bad_prompt_type(tmp_path: Path, registry: Registry) -> None:
    f = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "question": "b"}])
    with pytest.raises(DataError, match="both 'question'"):
        load_prompts(_config(dataset={"path": str(f), "prompt_column": "question"}), registry)
    g = _jsonl(tmp_path / "n.jsonl", [{"prompt": 5}])
    with pytest.raises(DataError, match="prompt 0 is a int"):
        load_prompts(_config(dataset={"path": str(g)}), registry)


def test_empty_dataset_is_an_error(tmp_path: Path, registry: Registry) -> None:
    import datasets

    class Empty(Task):
        def load(self, seed: int):
            return datasets.Dataset.from_dict({"prompt": []})

    with registry.temporary("task", "empty", Empty):
        with pytest.raises(DataError, match="task 'empty' is empty"):
            load_prompts(_config(task="empty"), registry)


def test_hub_name_not_in_cache_says_it_cannot_download(tmp_path: Path, registry: Registry, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError, match="cannot download"):
        load_prompts(_config(dataset={"path": "nobody/no-such-dataset"}), registry)


def test_neither_dataset_nor_task(registry: Registry) -> None:
    with pytest.raises(DataError, match="neither a dataset nor a task"):
        load_prompts(_config(), registry)


# -- encoding -------------------------------------------------------------------------------------


def test_string_prompts_are_tokenized_as_they_are(tokenizer) -> None:
    assert encode_prompts(tokenizer, ["ab", "c"], max_prompt_length=None) == [
        tokenizer("ab")["input_ids"],
        tokenizer("c")["input_ids"],
    ]
    assert tokenizer.decode(encode_prompts(tokenizer, ["hi!"], max_prompt_length=8)[0]) == "hi!"


def test_chat_prompts_use_the_template_with_a_generation_prompt(tokenizer) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]
    (ids,) = encode_prompts(tokenizer, [chat], max_prompt_length=None)
    assert tokenizer.decode(ids) == "<|system|>be brief\n<|user|>2+2\n<|assistant|>"


def test_too_long_prompt_raises_naming_index_length_and_setting(tokenizer) -> None:
    with pytest.raises(PromptTooLongError) as info:
        encode_prompts(tokenizer, ["ok", "much too long"], max_prompt_length=5)
    message = str(info.value)
    assert "prompt 1 is 13 tokens" in message and "max_prompt_length=5" in message
    assert "prompt_truncation" in message


def test_left_truncation_keeps_the_last_tokens(tokenizer) -> None:
    (ids,) = encode_prompts(tokenizer, ["abcdefgh"], max_prompt_length=3, truncation="left")
    assert tokenizer.decode(ids) == "fgh"


def test_chat_prompt_without_template_is_a_clear_error(tokenizer) -> None:
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(DataError, match="no chat template"):
            encode_prompts(tokenizer, [[{"role": "user", "content": "x"}]], max_prompt_length=None)
    finally:
        tokenizer.chat_template = template


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_an_empty_json_file_is_a_clear_error(tmp_path: Path) -> None:
    from grpo_plugins.config import DatasetSpec
    from grpo_plugins.data import DataError, load_dataset_spec

    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_dataset_spec(DatasetSpec(path=str(empty)))
