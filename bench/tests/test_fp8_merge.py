"""bench/fp8_merge.py on the CPU: the torch path is timed for every projection of a shape and
totalled per model; the agreement measure (fp8_rounding.merge_agreement) finds no difference
in a merge against itself and many in one with other noise."""

from __future__ import annotations

import torch

from bench import fp8_merge
from grpo_plugins.fp8_base import quantize_rows
from grpo_plugins.fp8_rounding import merge_agreement, merge_rows_reference


def test_the_torch_path_is_timed_per_projection_and_totalled_per_model() -> None:
    result = fp8_merge.measure("tiny", repeats=1, device=torch.device("cpu"), use_kernel=False)
    layers, projections = fp8_merge.SHAPES["tiny"]
    assert [r["projection"] for r in result["projections"]] == [p[0] for p in projections]
    assert all(r["torch_ms"] > 0 and "kernel_ms" not in r for r in result["projections"])
    expected = layers * sum(r["torch_ms"] * r["per_layer"] for r in result["projections"])
    assert abs(result["per_model_ms"]["torch_ms"] - expected) < 1e-9 and "kernel_ms" not in result["per_model_ms"]


def test_agreement_sees_other_rounding_and_nothing_in_the_same() -> None:
    weight8, scale = quantize_rows(torch.randn(40, 64))
    delta = torch.randn(40, 64) * 0.05 * scale
    merged = merge_rows_reference(weight8, scale[:, 0], delta, seed=1)
    same = merge_agreement(merged, merge_rows_reference(weight8, scale[:, 0], delta, seed=1))
    assert same == {"bits_differ": 0.0, "largest_grid_steps": 0.0, "scale_rel_error": 0.0}
    other = merge_agreement(merged, merge_rows_reference(weight8, scale[:, 0], delta, seed=2))
    assert other["bits_differ"] > 0.005 and 0.5 < other["largest_grid_steps"] <= 1.01  # neighbouring grid points
