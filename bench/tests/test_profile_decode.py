"""bench/profile_decode.py's timing of the parts of a ``generate`` outside its decode steps."""

from __future__ import annotations

from pathlib import Path

from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec


def test_the_outside_decode_timing_splits_a_generate_and_restores_the_decoder(tmp_path: Path) -> None:
    import bench.profile_decode as profile
    import grpo_plugins.generators.static_decode as static_decode

    model, _ = load_model(tiny_model_spec(tmp_path / "qwen2", "qwen2"), dtype="float32", seed=0)
    dec = profile._decoder(model, 4, {"merge_weights": True})  # uncompiled on a CPU
    prefill, decode_parts = static_decode.prefill_distinct, dec._decode_parts
    spent = profile._time_outside_decode(dec, [[5, 6, 7], [8, 9]])
    assert 0 < spent["prefill_s"] < spent["generate_s"]
    assert 0 < spent["refresh_weights_s"] < spent["generate_s"]
    assert static_decode.prefill_distinct is prefill and dec._decode_parts == decode_parts
