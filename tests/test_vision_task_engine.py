"""The ``shapes`` task in a run: a tiny vision-language model trains on it from a config, and a
reward receives the pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from grpo_plugins.engine import Engine

TASK = {"name": "shapes", "params": {"num_samples": 8, "num_eval_samples": 2, "image_size": 64, "max_count": 3, "max_distractors": 1}}


def _config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "task": TASK,
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 4,
        "max_prompt_length": 512,
        "lora": {"r": 4, "lora_alpha": 8},
        "report_to": [],
        "seed": 0,
        **overrides,
    }


def test_a_tiny_vlm_trains_on_the_task_from_a_config(tmp_path):
    from grpo_plugins.testing.tiny_vision import save_tiny_vlm

    folder = save_tiny_vlm(tmp_path / "tiny-vlm")
    history = Engine(_config(tmp_path, model=str(folder))).train().history
    assert len(history) == 1
    record = history[0]
    assert {"rewards/correct_answer/mean", "rewards/format/mean"} <= set(record)
    assert 0.0 <= record["reward"] <= 1.5


def test_rewards_receive_the_pictures_of_their_prompts(tmp_path):
    from grpo_plugins.registry import get_registry
    from grpo_plugins.testing.tiny_vision import build_tiny_vlm

    task = get_registry().build("task", "shapes", TASK["params"])
    data = task.load(0)
    seen: list[tuple[str, Any]] = []

    def spy(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        seen.extend(zip(columns["question"], columns["image"]))
        return [0.0] * len(completions)

    model, processor = build_tiny_vlm("qwen2_vl")
    Engine(_config(tmp_path, task=None), model=model, tokenizer=processor, rewards=[spy], dataset=data).train()
    assert len(seen) == 4
    by_question = {}
    for row in task.rows(0):
        by_question.setdefault(row["question"], []).append(row["image"].tobytes())
    for question, image in seen:
        assert isinstance(image, Image.Image) and image.size == (64, 64)
        assert image.convert("RGB").tobytes() in by_question[question]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_a_tiny_vlm_raises_its_reward_on_the_task_over_sixty_steps(arch: str, tmp_path: Path) -> None:
    """Seeded GRPO on ``shapes`` with a tiny random VLM: the share of right counts rises from the
    few a random model hits (~0.05) to a third or so. A model this small learns to answer with a
    count in the task's range; whether it also reads the pictures is not what this shows."""
    from grpo_plugins.testing.tiny_vision import build_tiny_vlm

    params = {"num_samples": 64, "num_eval_samples": 2, "image_size": 64, "max_count": 3, "max_distractors": 1}
    model, processor = build_tiny_vlm(arch)
    config = {
        "task": {"name": "shapes", "params": params}, "output_dir": str(tmp_path / "out"), "max_steps": 60,
        "per_device_train_batch_size": 32, "num_generations": 8, "max_completion_length": 4, "max_prompt_length": 512,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "loss_type": "dapo", "steps_per_generation": 1,
        "report_to": [], "seed": 0,
    }
    right = [r["rewards/correct_answer/mean"] for r in Engine(config, model=model, tokenizer=processor).train().history]
    first, last = sum(right[:10]) / 10, sum(right[-10:]) / 10
    # Seeds 0-4, both architectures: first 10 steps 0.02-0.05, last 10 steps 0.22-0.41.
    assert first < 0.1 and last > first + 0.12, right
