"""The example environment ``second_chance`` with a scripted policy: a wrong first answer gets the
teacher's feedback and a second try; only the model's tokens carry the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_plugins.kinds import EnvironmentSettings
from grpo_plugins.testing import ScriptedGenerator, build_tiny_tokenizer, check_component, scripted_setup
from grpo_plugins_example.environment import SecondChance


def test_it_satisfies_the_environment_interface() -> None:
    check_component("environment", SecondChance, sample={"reply": "<answer>4</answer>"})


def test_a_wrong_answer_gets_feedback_and_a_second_try(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path)))
    # First try wrong (5), second right (4) -- unless the first was right already.
    policy = ScriptedGenerator(lambda prompt: "<answer>4</answer>" if "Try again" in prompt or "7" in prompt else "<answer>5</answer>")
    env = SecondChance()
    env.setup(scripted_setup(policy, tokenizer, 64), tokenizer, EnvironmentSettings(64, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    prompts = [[{"role": "user", "content": "2 + 2?"}], [{"role": "user", "content": "7 - 3?"}]]
    out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {"answer": ["4", "4"]})
    assert out.info == {"attempts": [2, 1]}
    assert out.stats == {"turns": [2.0, 1.0], "wrong_answers": [1.0, 0.0]}
    assert [m["content"] for m in out.completions[0]] == ["<answer>5</answer>", "That is not right. Try again.", "<answer>4</answer>"]
    model_text = tokenizer.decode(out.completion_ids[0][out.model_mask[0].bool()].tolist())
    assert model_text == "<answer>5</answer></s><answer>4</answer></s>"
