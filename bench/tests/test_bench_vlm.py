"""bench/bench_vlm.py on a CPU: the model is Qwen2.5-VL-3B's shape, LoRA lands on the language model
only, a picture becomes the expected image tokens, and both sides run end to end with --tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def bench_vlm():
    import bench.bench_vlm as module

    return module


def test_the_model_has_qwen2_5_vl_3b_parameters(bench_vlm):
    from transformers import AutoModelForImageTextToText

    config = bench_vlm.model_config(False, bench_vlm.build_processor(True, 448))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 3_754_622_976  # Qwen2.5-VL-3B-Instruct's count
    assert sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}") == 668_684_288


def test_a_picture_becomes_its_patches_and_image_tokens(bench_vlm):
    from trl.data_utils import prepare_multimodal_messages

    processor = bench_vlm.build_processor(True, 448)
    row = bench_vlm.dataset(448, n=1)[0]
    messages = prepare_multimodal_messages(row["prompt"], [row["image"]])
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert out["pixel_values"].shape == (1024, 3 * 2 * 14 * 14)  # (448/14)^2 patches of 2 frames
    assert int((out["input_ids"] == image_token).sum()) == 256  # 2x2 patches merge into one token
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]


def test_lora_targets_are_the_language_models_linear_layers(bench_vlm):
    from peft import LoraConfig, get_peft_model

    processor = bench_vlm.build_processor(True, 56)
    model = bench_vlm.build_model(bench_vlm.model_config(True, processor))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=bench_vlm.LANGUAGE_LORA_TARGETS))
    adapted = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 7 and all(".language_model.layers." in n for n in adapted)


def test_tiny_runs_of_both_frameworks_make_the_table(bench_vlm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    results = bench_vlm.main(["--tiny", "--tokens", "4", "--steps", "1", "--warmup", "1", "--image-size", "56"])
    ours, trl = results["runs"]["4"]["ours"], results["runs"]["4"]["trl"]
    assert "error" not in ours and "error" not in trl, (ours, trl)
    assert len(ours["step_times"]) == 2 and len(ours["losses"]) == 2 and 1 <= ours["mean_length"] <= 4
    assert ours["generate_s"] > 0 and ours["train_s"] > 0
    assert "4 trl / ours" in " ".join(capsys.readouterr().out.split())
    assert "GRPOTrainer.transformers.generate" in trl["profiling_names"] and 1 <= trl["mean_length"] <= 4
    saved = json.loads((tmp_path / "vlm_bench.json").read_text())["runs"]["4"]
    assert saved["ours"]["step_s"] == ours["step_s"] and saved["trl"]["step_s"] == trl["step_s"]


def test_several_generators_give_one_ours_run_each(bench_vlm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    results = bench_vlm.main([
        "--tiny", "--tokens", "4", "--steps", "1", "--warmup", "1", "--image-size", "56",
        "--frameworks", "ours", "--generator", "transformers", "static",
    ])
    runs = results["runs"]["4"]
    assert set(runs) == {"ours transformers", "ours static"}
    for run in runs.values():
        assert "error" not in run, run
        assert len(run["losses"]) == 2 and 1 <= run["mean_length"] <= 4
