"""The reward-model reward: a tiny random sequence-classification model saved to a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_plugins.registry import Registry
from grpo_plugins.rewards import RewardRunner
from grpo_plugins.testing import build_tiny_tokenizer, tiny_model_config


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    directory = tmp_path_factory.mktemp("reward_model")
    build_tiny_tokenizer(directory)
    config = LlamaConfig(**{k: v for k, v in tiny_model_config("llama").items() if k not in ("model_type", "architectures")}, num_labels=1)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    assert AutoTokenizer.from_pretrained(directory).pad_token == "<pad>"
    return directory


def test_scores_match_the_model_one_sample_at_a_time(reward_model_dir: Path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    registry = Registry()
    rm = registry.build("reward", "reward_model", {"model_path": str(reward_model_dir), "batch_size": 2})
    prompts = ["2+2=", "Name a colour:", "hi", "Say yes.", "x"]
    completions = ["4", "blue, or maybe a much longer answer", "hello there", "yes", "y"]
    scores = rm(prompts, completions)
    assert len(scores) == 5 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) > 1  # a random model still tells inputs apart

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():
        single = [model(**tok(f"{p}\n{c}", return_tensors="pt")).logits[0, 0].item() for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(single, abs=1e-4)  # batching with padding changes nothing


def test_conversational_uses_the_chat_template_and_runs_in_the_runner(reward_model_dir: Path):
    prompts = [[{"role": "user", "content": "2+2?"}]] * 3
    spec = {"name": "reward_model", "params": {"model_path": str(reward_model_dir), "device": "cpu", "scale": 2.0}}
    with RewardRunner([spec], Registry()) as runner:
        out = runner(prompts, ["4", "5", "4"], None, {})
    assert out.shape == (3, 1)
    assert out[0, 0].item() == pytest.approx(out[2, 0].item()) and out[0, 0].item() != out[1, 0].item()
