"""The built-in image task ``shapes``: deterministic pictures, answers that the pixels bear out,
a held-out split of other questions, TRL's prompt format, and its default rewards."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from grpo_plugins.config import GRPOConfig
from grpo_plugins.registry import ComponentParamsError, Registry
from grpo_plugins.rewards import RewardRunner, reward_specs_for
from grpo_plugins.testing import check_component

from builtin_rewards.vision_tasks import BACKGROUND, COLORS, ShapesTask


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()


def task(registry: Registry, **params) -> ShapesTask:
    return registry.build("task", "shapes", params)


def components(image: Image.Image) -> list[tuple[str, np.ndarray]]:
    """The 4-connected regions of one non-background colour: (colour name, boolean mask) each."""
    pixels = np.asarray(image.convert("RGB"))
    names = {rgb: name for name, rgb in COLORS.items()}
    seen = np.zeros(pixels.shape[:2], dtype=bool)
    h, w = seen.shape
    out = []
    for y0 in range(h):
        for x0 in range(w):
            rgb = tuple(int(v) for v in pixels[y0, x0])
            if seen[y0, x0] or rgb == BACKGROUND:
                continue
            assert rgb in names, f"pixel {rgb} is neither background nor a task colour"
            mask = np.zeros_like(seen)
            queue = deque([(y0, x0)])
            seen[y0, x0] = True
            while queue:
                y, x = queue.popleft()
                mask[y, x] = True
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and tuple(int(v) for v in pixels[ny, nx]) == rgb:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
            out.append((names[rgb], mask))
    return out


def kind(mask: np.ndarray) -> str:
    """A region's shape from its pixels: how much of its bounding box it fills, and its rows' widths."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    fill = box.mean()
    if fill > 0.93:
        return "square"
    if fill > 0.7:
        return "circle"
    widths = box.sum(axis=1)
    return "triangle" if widths[-1] > 0.8 * box.shape[1] else "diamond"


def test_meets_the_task_contract():
    check_component("task", ShapesTask, name="shapes", params={"num_samples": 8, "num_eval_samples": 4})


def test_same_seed_same_pictures_other_seed_other_pictures(registry):
    t = task(registry, num_samples=12, num_eval_samples=6)
    first, again, other = t.rows(1), t.rows(1), t.rows(2)
    assert [r["question"] for r in first] == [r["question"] for r in again]
    assert all(np.array_equal(np.asarray(a["image"]), np.asarray(b["image"])) for a, b in zip(first, again))
    assert sum(np.array_equal(np.asarray(a["image"]), np.asarray(b["image"])) for a, b in zip(first, other)) == 0
    assert t.scenes(3, held_out=True) == t.scenes(3, held_out=True) != t.scenes(4, held_out=True)
    fixed = task(registry, num_samples=12, seed=7)
    assert fixed.scenes(1) == fixed.scenes(2)  # params.seed overrides the run's seed


@pytest.mark.parametrize(
    "params",
    [{}, {"shapes": ["circle", "square", "triangle", "diamond"], "colors": ["red", "blue"], "max_count": 9, "max_distractors": 6, "image_size": 160}],
)
def test_answers_are_what_the_pictures_show(registry, params):
    t = task(registry, num_samples=25, **params)
    counts = set()
    for row, scene in zip(t.rows(5), t.scenes(5)):
        found = [(color, kind(mask)) for color, mask in components(row["image"])]
        assert sorted(found) == sorted((p.color, p.shape) for p in scene.shapes)
        asked = row["question"].removeprefix("How many ").removesuffix("s are in the image?").split(" ")
        assert row["answer"] == str(found.count(tuple(asked))) == str(scene.answer)
        counts.add(scene.answer)
    assert min(counts) >= t.params.min_count and max(counts) <= t.params.max_count and len(counts) >= 3


def test_held_out_split_asks_other_pairs_and_shares_no_prompt(registry):
    t = task(registry, num_samples=200, num_eval_samples=50)
    train, held_out = set(t.pairs(False)), set(t.pairs(True))
    assert train.isdisjoint(held_out) and len(train | held_out) == 12 and len(held_out) == 4
    assert {c for c, _ in train} == set(t.params.colors) and {s for _, s in train} == set(t.params.shapes)
    for seed in (0, 1):
        train_prompts = {json.dumps(p, sort_keys=True) for p in t.load(seed)["prompt"]}
        eval_prompts = [json.dumps(p, sort_keys=True) for p in t.load_eval(seed)["prompt"]]
        assert len(eval_prompts) == 50 and train_prompts.isdisjoint(eval_prompts)
    asked = {tuple(q.split(" ")[2:4]) for q in t.load_eval(0)["question"]}
    assert asked == {(c, s + "s") for c, s in held_out}


def test_prompts_are_trl_conversational_prompts_with_one_image(registry):
    from trl.data_utils import is_conversational, prepare_multimodal_messages

    row = task(registry, num_samples=1).rows(0)[0]
    (user,) = row["prompt"]
    assert user["role"] == "user"
    assert user["content"][0] == {"type": "image"}
    assert user["content"][1]["type"] == "text" and user["content"][1]["text"].startswith(row["question"])
    assert "<answer>" in user["content"][1]["text"]
    assert is_conversational(row)
    filled = prepare_multimodal_messages(row["prompt"], [row["image"]])  # one placeholder for one image
    assert filled[0]["content"][0]["image"] is row["image"]
    system = task(registry, num_samples=1, system_prompt="Count carefully.").rows(0)[0]["prompt"][0]
    assert system == {"role": "system", "content": [{"type": "text", "text": "Count carefully."}]}


def test_load_stores_the_pictures_as_an_image_column(registry):
    import datasets

    t = task(registry, num_samples=4, image_size=64, max_count=3, max_distractors=1)
    ds = t.load(0)
    assert ds.column_names == ["prompt", "image", "question", "answer"] and len(ds) == 4
    assert isinstance(ds.features["image"], datasets.Image)
    for stored, row in zip(ds, t.rows(0)):
        assert isinstance(row["image"], Image.Image) and row["image"].size == (64, 64)
        assert np.array_equal(np.asarray(stored["image"]), np.asarray(row["image"]))  # PNG: lossless
        assert stored["prompt"][0]["content"][1]["text"] == row["prompt"][0]["content"][1]["text"]


def test_params_are_checked(registry):
    with pytest.raises(ComponentParamsError, match="max_count must be >= min_count"):
        task(registry, min_count=4, max_count=2)
    with pytest.raises(ComponentParamsError, match="image_size 64 is too small for 40 shapes"):
        task(registry, image_size=64, max_count=20, max_distractors=20)
    with pytest.raises(ComponentParamsError, match="colors"):
        task(registry, colors=["red"])
    with pytest.raises(ComponentParamsError, match="shapes"):
        task(registry, shapes=["circle", "hexagon"])


def test_default_rewards_score_right_and_wrong_counts(registry):
    specs = reward_specs_for(GRPOConfig(rewards=[]), registry.get("task", "shapes"))
    assert [(s.name, s.weight) for s in specs] == [("correct_answer", 1.0), ("format", 0.5)]
    rows = task(registry, num_samples=4).rows(0)
    answers = [r["answer"] for r in rows]
    completions = [
        [{"role": "assistant", "content": f"I count them. <answer>{answers[0]}</answer>"}],
        [{"role": "assistant", "content": f"There are {answers[1]}."}],  # right, no answer tags
        [{"role": "assistant", "content": f"<answer>{int(answers[2]) + 1}</answer>"}],  # well formatted, wrong
        [{"role": "assistant", "content": "A picture of shapes."}],
    ]
    columns = {"answer": answers, "image": [r["image"] for r in rows]}
    with RewardRunner(specs, registry) as runner:
        out = runner([r["prompt"] for r in rows], completions, None, columns)
    assert out.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vision_shapes_smolvlm.yaml"


@pytest.mark.parametrize("arch", ["idefics3", "qwen2_vl"])
def test_the_example_puts_lora_on_the_language_model_only(arch):
    import yaml

    from grpo_plugins.models import apply_lora
    from grpo_plugins.testing.tiny_vision import build_tiny_vlm

    model, _ = build_tiny_vlm(arch)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    peft_model = apply_lora(model, yaml.safe_load(EXAMPLE.read_text())["lora"])
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in peft_model.named_modules() if n.endswith(".lora_A")}
    language = {n for n in names if ".layers." in n and ("text_model" in n or "language_model" in n)}
    assert adapted == language and len(language) == 2 * 7  # 2 layers x q k v o gate up down
    assert any("vision" in n or "visual" in n for n in names)  # there is a vision side, left alone


def test_the_example_validates_and_names_a_missing_model_folder(tmp_path, capsys):
    from grpo_plugins import cli
    from grpo_plugins.testing.tiny_vision import save_tiny_vlm

    missing = tmp_path / "no-such-model"
    assert cli.main(["validate", str(EXAMPLE), "--set", f"model={missing}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid config") and f"model: no such file or directory: {missing}" in err
    assert "Traceback" not in err
    folder = save_tiny_vlm(tmp_path / "tiny-vlm")
    assert cli.main(["validate", str(EXAMPLE), "--set", f"model={folder}"]) == 0
    assert "rewards (task shapes's defaults): correct_answer x 1, format x 0.5" in capsys.readouterr().out
