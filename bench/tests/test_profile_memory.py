"""bench/profile_memory.py in its CPU mode: every phase is recorded per step, and the byte counts
of the steady parts equal what the tiny LoRA model's shapes say they must be."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def profile_memory(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.profile_memory as module

    return module


def test_cpu_dry_run_records_phases_and_exact_byte_counts(profile_memory, tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    profile_memory.main(
        ["--tiny", "--tokens", "4", "--rows", "4", "--steps", "1", "--warmup", "1", "--beta", "0.1",
         "--variants", "default", "--torch-profile", str(tmp_path / "prof"), "--out", str(out)]
    )
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    run = data["runs"]["default"]
    assert len(run["step_times"]) == 2 and all(t > 0 for t in run["step_times"])
    assert [s["step"] for s in run["per_step"]] == [1, 2]
    phases = {c["phase"] for c in run["calls"]}
    assert phases == {"generate", "reward", "ref_logps", "train", "optimizer"}
    assert {c["step"] for c in run["calls"] if c["phase"] == "train"} == {1, 2}
    assert set(run["phases"]) == phases  # the measured step (2) has every phase
    assert (tmp_path / "prof" / "profile_smol-vocab-0.4b_default_train_step2.txt").is_file()

    # The tiny shape (bench/_common.py, TINY): hidden 64, 2 layers, 4 heads (dim 16) with 2 KV
    # heads, MLP 128, LoRA r=16 on q, k, v, o, gate, up, down: r * (in + out) each.
    r, H, kv, I, L = 16, 64, 32, 128, 2
    lora = L * r * ((H + H) + (H + kv) * 2 + (H + H) + (H + I) * 2 + (I + H))
    parts = run["parts"]
    assert parts["trainable_params"] == lora
    gib = 2**30
    assert parts["trainable_weights_gib"] * gib == 4 * lora  # float32 adapters
    assert parts["gradients_gib"] * gib == 4 * lora
    lora_tensors = L * 7 * 2
    assert parts["optimizer_state_gib"] * gib == 2 * 4 * lora + 4 * lora_tensors  # exp_avg, exp_avg_sq, step
    assert parts["master_copies_gib"] == 0.0
    # One static KV cache: L layers x (k, v) x 4 rows x 2 KV heads x S positions x 16 dims, fp32,
    # S = prompt bucket (multiple of 64) + 4 completion tokens.
    assert parts["generator_graphs"] == 1
    prompt_bucket = 64 * -(-max(len(p) for p in sys.modules["bench._common"].prompt_texts(64)) // 64)
    kv_bytes = L * 2 * 4 * 2 * (prompt_bucket + 4) * 16 * 4
    assert kv_bytes <= parts["generator_cache_gib"] * gib < kv_bytes * 1.05


def test_unknown_variant_is_refused(profile_memory) -> None:
    with pytest.raises(SystemExit):
        profile_memory.main(["--tiny", "--variants", "nope"])


@pytest.mark.parametrize("factor", [0.0, 1e9])
def test_profile_slow_keeps_the_tables_of_slow_passes_only(profile_memory, tmp_path: Path, factor: float) -> None:
    """--profile-slow profiles every measured training pass and writes the tables of those slower
    than factor x the median before them (with the last normal pass's); factor 0 makes every
    pass from the third measured one on "slow", 1e9 none."""
    out, prof = tmp_path / "mem.json", tmp_path / "prof"
    profile_memory.main(
        ["--tiny", "--tokens", "4", "--rows", "4", "--steps", "4", "--warmup", "1", "--variants", "default",
         "--torch-profile", str(prof), "--profile-slow", str(factor), "--out", str(out)]
    )
    run = json.loads(out.read_text())["runs"]["default"]
    written = sorted(p.name.removeprefix("profile_smol-vocab-0.4b_default_train_") for p in prof.glob("*.txt")) if prof.exists() else []
    if factor == 0.0:
        assert run["slow_steps"] == [4, 5]  # steps 2 and 3 are the median's first two passes
        assert written == ["step3_normal.txt", "step4_slow.txt", "step5_slow.txt"]
        assert "(slow): by device time" in (prof / "profile_smol-vocab-0.4b_default_train_step5_slow.txt").read_text()
    else:
        assert run["slow_steps"] == [] and written == []


def test_profile_slow_needs_a_folder(profile_memory) -> None:
    with pytest.raises(SystemExit):
        profile_memory.main(["--tiny", "--profile-slow", "2"])


@pytest.mark.parametrize("freeze", [True, False])
def test_garbage_collection_is_timed_per_call_and_the_freeze_can_be_left_out(
    profile_memory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, freeze: bool
) -> None:
    from grpo_plugins.heap import LongLivedObjects

    freezes: list[int] = []
    real_freeze = LongLivedObjects.freeze

    def counted(self: LongLivedObjects) -> None:
        freezes.append(1)
        real_freeze(self)

    monkeypatch.setattr(LongLivedObjects, "freeze", counted)
    out = tmp_path / "mem.json"
    profile_memory.main(
        ["--tiny", "--tokens", "4", "--rows", "4", "--steps", "2", "--warmup", "1", "--variants", "default",
         "--out", str(out)] + ([] if freeze else ["--no-gc-freeze"])
    )
    run = json.loads(out.read_text())["runs"]["default"]
    assert (len(freezes) > 0) is freeze
    for call in run["calls"]:
        assert 0.0 <= call["gc_full_s"] <= call["gc_s"] <= call["wall_s"] + 1e-3
    for step in run["per_step"]:
        assert 0.0 <= step["train_gc_full_s"] <= step["train_gc_s"] <= step["gc_s"]
