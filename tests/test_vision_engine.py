"""Vision-language models in training runs (tiny random Qwen2-VL and Idefics3, float32 on CPU):
prompts with images train on-policy with an importance ratio of exactly 1 through length-grouped
row chunks and dynamic sampling, the vision side stays frozen, rewards receive the images, a
run resumed from a mid-cycle checkpoint ends exactly as an uninterrupted one, and a text model
given images fails with one clear message."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.config import ConfigError
from grpo_plugins.engine import Engine
from grpo_plugins.errors import GRPOPluginsError, TrainingError
from grpo_plugins.image_prompts import load_image
from grpo_plugins.metrics import read_metrics
from grpo_plugins.testing import ScriptedGenerator, registered_component
from grpo_plugins.testing.tiny_vision import VISION_ARCHS, build_tiny_vlm, save_tiny_vlm, tiny_image
from grpo_plugins.validation import validate_config


def _data(n: int = 4) -> list[dict[str, Any]]:
    """Prompts of different lengths, one image each (different sizes)."""
    return [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q" + "?" * i}]}],
            "image": tiny_image(i, side=16 if i % 2 else 24),
        }
        for i in range(n)
    ]


def image_reward(completions: list[Any], image: list[Any], **kwargs: Any) -> list[float]:
    """Reads the prompt's image (as the dataset holds it: a PIL image or a file path): the
    completion length plus the image's first red value, mod 5."""
    red = [load_image(i).getpixel((0, 0))[0] for i in image]
    return [float((len(c[0]["content"]) + red[k]) % 5) for k, c in enumerate(completions)]


def _config(out: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "model": "unused-when-a-model-is-given", "task": None, "output_dir": str(out), "max_steps": 2,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 2,
        "num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2, "report_to": ["jsonl"],
        "seed": 0, "dtype": "float32", **overrides,
    }


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_images_train_on_policy_with_a_ratio_of_exactly_one(arch: str, tmp_path: Path, monkeypatch: Any) -> None:
    import grpo_plugins.objective as objective

    seen: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
    original = objective.compute_loss

    def recording(per_token_logps: Any, old: Any, advantages: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((per_token_logps.detach().clone(), None if old is None else old.clone(), mask.clone()))
        return original(per_token_logps, old, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(objective, "compute_loss", recording)
    images_seen: list[Any] = []

    def reward(prompts: list[Any], completions: list[Any], image: list[Any], **kwargs: Any) -> list[float]:
        images_seen.extend(image)
        varied = image_reward(completions, image)
        # Every other prompt's group scores all alike: drop_zero_std drops it and refills.
        return [1.0 if p[0]["content"][1]["text"].count("?") % 2 == 0 else v for p, v in zip(prompts, varied)]

    model, processor = build_tiny_vlm(arch)
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if "lm_head" not in n and "language_model" not in n and "text_model" not in n}
    config = _config(
        tmp_path / "out", per_device_train_batch_size=8, train_chunk_rows=2, group_by_length=True,
        lora={"r": 4, "lora_alpha": 8}, group_filter="drop_zero_std", learning_rate=5e-2, beta=0.04,
    )
    engine = Engine(config, model=model, tokenizer=processor, rewards=[reward], dataset=_data(8))
    engine.train()
    assert sum(r["group_filter/groups_dropped"] for r in read_metrics(tmp_path / "out")) > 0
    # The cycle's first step runs before any update: its passes see the old log-probs exactly.
    first = seen[: len(seen) // 2]
    assert len(first) > 1  # several row chunks
    for logps, old, mask in first:
        assert old is not None and logps.shape == old.shape
        active = mask != 0
        assert active.any() and torch.equal(logps[active], old[active])
    assert images_seen and all(hasattr(i, "getpixel") for i in images_seen)  # rewards get the PIL images
    names = [n for n, _ in engine.unwrapped.named_parameters() if "lora_" in n]
    assert names and not any(k in n for n in names for k in ("visual", "vision_model", "connector"))
    trained = dict(engine.unwrapped.get_base_model().named_parameters())
    for name, before in vision.items():  # the vision side is frozen
        assert torch.equal(trained[name], before), name


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_resuming_a_mid_cycle_checkpoint_ends_as_an_uninterrupted_run(arch: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = _config(straight, max_steps=3, save_steps=1, save_total_limit=None, lr_scheduler_type="constant")
    model, processor = build_tiny_vlm(arch)
    Engine(config, model=model, tokenizer=processor, rewards=[image_reward], dataset=_data()).train()
    # A run killed after step 1: its checkpoint holds the cycle's rollout (step 2 comes from it).
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-1", resumed / "checkpoints" / "checkpoint-1")
    assert (resumed / "checkpoints" / "checkpoint-1" / "rollout_0.pt").is_file()
    model, processor = build_tiny_vlm(arch)
    result = Engine({**config, "output_dir": str(resumed)}, model=model, tokenizer=processor,
                    rewards=[image_reward], dataset=_data()).train(resume=True)
    assert result.global_step == 3
    a = load_file(str(straight / "checkpoints" / "checkpoint-3" / "model" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "checkpoint-3" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    first = load_file(str(straight / "checkpoints" / "checkpoint-1" / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], first[k]) for k in a)  # steps 2 and 3 changed the weights
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _image_jsonl(tmp_path: Path) -> Path:
    rows = []
    for i in range(4):
        path = tmp_path / f"img{i}.png"
        tiny_image(i).save(path)
        rows.append({"prompt": [{"role": "user", "content": f"What is in picture {i}?"}], "image": str(path)})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_a_model_folder_trains_on_image_files_from_the_config(tmp_path: Path) -> None:
    folder = save_tiny_vlm(tmp_path / "vlm", "idefics3")
    config = {
        **_config(tmp_path / "out", max_steps=1, steps_per_generation=1), "model": str(folder),
        "dataset": {"path": str(_image_jsonl(tmp_path))}, "lora": {"r": 2, "lora_alpha": 4},
    }
    validate_config({**config, "rewards": ["length"]})
    engine = Engine(config, rewards=[image_reward])
    result = engine.train()
    assert result.global_step == 1
    assert type(engine.unwrapped.get_base_model()).__name__ == "Idefics3ForConditionalGeneration"
    assert (result.checkpoint / "model" / "processor_config.json").is_file()  # the processor is saved


def test_a_text_model_given_images_fails_validate_and_train_with_one_message(tiny_model: dict, tmp_path: Path) -> None:
    config = {**_config(tmp_path / "out"), "model": tiny_model, "dataset": {"path": str(_image_jsonl(tmp_path))}}
    with pytest.raises(ConfigError, match=r"dataset: the dataset's 'image' column holds images, but .* text-only model"):
        validate_config({**config, "rewards": ["length"]})
    with pytest.raises(TrainingError, match=r"image/images column but the model is a text-only model"):
        Engine(config, rewards=[image_reward]).train()


class _TextOnlyGenerator(ScriptedGenerator):
    """A generator that does not declare ``accepts_images``."""

    def __init__(self) -> None:
        super().__init__(lambda prompt: "ab")


def test_a_vision_model_refuses_a_text_only_generator_and_a_folder_without_its_processor(tmp_path: Path) -> None:
    folder = save_tiny_vlm(tmp_path / "vlm", "idefics3")
    data = {"path": str(_image_jsonl(tmp_path))}
    with registered_component("generator", _TextOnlyGenerator, "text_only"):
        with pytest.raises(ConfigError, match=r"generator: generator 'text_only' does not support prompts with images"):
            validate_config({**_config(tmp_path / "out"), "model": str(folder), "dataset": data, "generator": "text_only",
                             "rewards": ["length"]})
    (folder / "preprocessor_config.json").unlink(missing_ok=True)
    (folder / "processor_config.json").unlink()
    with pytest.raises(ConfigError, match=r"model: '.*vlm' is for a vision-language model but has no processor settings"):
        validate_config({**_config(tmp_path / "out"), "model": str(folder), "dataset": data, "rewards": ["length"]})
    model, processor = build_tiny_vlm("idefics3")
    with registered_component("generator", _TextOnlyGenerator, "text_only"):
        with pytest.raises(GRPOPluginsError, match=r"generator 'text_only' does not support prompts with images"):
            Engine({**_config(tmp_path / "out"), "generator": "text_only"}, model=model, tokenizer=processor,
                   rewards=[image_reward], dataset=_data()).train()


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_the_static_generator_trains_a_vision_model_with_the_policys_log_probs(arch: str, tmp_path: Path) -> None:
    """The static generator's sampled log-probs are the policy's: with the sampler/trainer
    correction forced on, every importance ratio it logs is 1 up to float32 rounding."""
    model, processor = build_tiny_vlm(arch)
    config = _config(tmp_path / "out", generator={"name": "static", "params": {"compile": False}},
                     lora={"r": 4, "lora_alpha": 8}, vllm_importance_sampling_correction=True)
    history = Engine(config, model=model, tokenizer=processor, rewards=[image_reward], dataset=_data()).train().history
    assert len(history) == 2 and all(math.isfinite(r["loss"]) for r in history)
    gaps = [r[k] for r in history for k in r if k.startswith("sampling/sampling_logp_difference")]
    assert gaps and max(gaps) < 1e-4, gaps


@pytest.mark.parametrize("train_vision_tower", [False, True])
def test_full_fine_tuning_trains_the_vision_tower_only_when_asked(train_vision_tower: bool, tmp_path: Path) -> None:
    model, processor = build_tiny_vlm("idefics3")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = _config(tmp_path / "out", max_steps=1, steps_per_generation=1, train_vision_tower=train_vision_tower)
    Engine(config, model=model, tokenizer=processor, rewards=[image_reward], dataset=_data()).train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    vision = {n for n in before if ".vision_model." in n or ".connector." in n}
    assert any(n.startswith("model.text_model.") for n in changed)
    assert bool(changed & vision) is train_vision_tower


def test_empty_slots_of_dynamic_sampling_keep_the_images_of_the_rows_they_borrow(tmp_path: Path, monkeypatch: Any) -> None:
    from grpo_plugins.policy import Policy

    passes: list[tuple[list[int], int]] = []  # (prompt indices, images) of every log-prob/training pass
    original = Policy.image_inputs

    def recording(self: Any, prompt_index: Any, ids: torch.Tensor, t: int) -> dict[str, torch.Tensor]:
        inputs = original(self, prompt_index, ids, t)
        passes.append((list(prompt_index), int(inputs["image_grid_thw"].shape[0]) if inputs else 0))
        return inputs

    monkeypatch.setattr(Policy, "image_inputs", recording)

    def reward(prompts: list[Any], completions: list[Any], image: list[Any], **kwargs: Any) -> list[float]:
        varied = image_reward(completions, image)
        return [1.0 if p[0]["content"][1]["text"].count("?") % 2 == 0 else v for p, v in zip(prompts, varied)]

    model, processor = build_tiny_vlm("qwen2_vl")
    config = _config(tmp_path / "out", max_steps=1, steps_per_generation=1, group_filter="drop_zero_std",
                     max_refill_rounds=0)
    result = Engine(config, model=model, tokenizer=processor, rewards=[reward], dataset=_data()).train()
    assert result.global_step == 1
    logged = read_metrics(tmp_path / "out")[-1]
    assert logged["group_filter/groups_dropped"] > 0 and math.isfinite(logged["loss"])
    assert passes and all(n == len(rows) and min(rows) >= 0 for rows, n in passes)  # one image per row, always


def test_a_config_and_a_processor_folder_make_a_random_vision_model(tmp_path: Path) -> None:
    from grpo_plugins.models import load_model
    from grpo_plugins.testing.tiny_vision import build_tiny_processor, tiny_vlm_config
    from grpo_plugins.vision_models import is_processor

    processor = build_tiny_processor("qwen2_vl")
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(tiny_vlm_config("qwen2_vl", processor).to_dict()))
    folder = save_tiny_vlm(tmp_path / "idefics", "idefics3")  # any processor folder will do for loading
    model, loaded = load_model({"config": str(config_path), "tokenizer": str(folder)}, dtype="float32",
                               lora={"r": 2, "lora_alpha": 4})
    assert type(model.get_base_model()).__name__ == "Qwen2VLForConditionalGeneration"
    assert is_processor(loaded) and loaded.tokenizer.padding_side == "left"
    adapters = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert adapters and not any(".visual." in n for n in adapters)
