"""bench/compare_examples.py: learning curves per setting over seeds, from run_example.py's summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import compare_examples


def _summary(reward: list[float], correct: list[float]) -> dict:
    windows = [(1, 30), (31, 60), (61, 90)][: len(reward)]
    return {
        "reward_windows": [[a, b, r] for (a, b), r in zip(windows, reward)],
        "rewards/correct_answer/mean_windows": [[a, b, c] for (a, b), c in zip(windows, correct)],
    }


def test_curves_average_seeds_per_window_and_keep_the_spread(tmp_path: Path) -> None:
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "example-bf16-s1.json").write_text(json.dumps(_summary([0.2, 0.5, 0.6], [0.1, 0.3, 0.4])))
    (tmp_path / "example-bf16-s2.json").write_text(json.dumps(_summary([0.4, 0.7, 0.8], [0.3, 0.5, 0.6])))
    (tmp_path / "example-fp8-s1.json").write_text(json.dumps(_summary([0.3, 0.6], [0.2, 0.4])))  # stopped early
    (tmp_path / "example-defaults.json").write_text("{}")  # not a seeded run: ignored
    runs = compare_examples.load_runs(tmp_path)
    assert sorted(runs) == ["bf16", "fp8"] and sorted(runs["bf16"]) == [1, 2]
    bf16 = compare_examples.curves(runs["bf16"], "reward")
    assert [(w["first"], w["last"], w["seeds"]) for w in bf16] == [(1, 30, 2), (31, 60, 2), (61, 90, 2)]
    assert bf16[1]["mean"] == pytest.approx(0.6) and (bf16[1]["low"], bf16[1]["high"]) == (0.5, 0.7)
    fp8 = compare_examples.curves(runs["fp8"], "rewards/correct_answer/mean")
    assert [w["mean"] for w in fp8] == [0.2, 0.4]
    text = compare_examples.table(runs, "reward")
    assert "bf16 (seeds [1, 2]): 1-30: 0.300 [0.200, 0.400]" in text and "fp8 (seeds [1])" in text


def test_held_out_evaluations_are_averaged_per_setting(tmp_path: Path) -> None:
    def evaluation(reward: float, greedy: float, correct: float) -> dict:
        return {"reward": reward, "greedy_reward": greedy, "rewards": [{"name": "correct_answer", "mean": correct, "greedy": None}]}

    (tmp_path / "eval-bf16-s1.json").write_text(json.dumps(evaluation(0.8, 0.9, 0.4)))
    (tmp_path / "eval-bf16-s2.json").write_text(json.dumps(evaluation(0.6, 0.7, 0.2)))
    (tmp_path / "example-bf16-s1.json").write_text(json.dumps(_summary([0.2], [0.1])))
    evals = compare_examples.load_runs(tmp_path, "eval")
    assert list(evals) == ["bf16"] and sorted(evals["bf16"]) == [1, 2]
    assert list(compare_examples.load_runs(tmp_path)) == ["bf16"]  # the summaries, not the evaluations
    text = compare_examples.held_out(evals)
    assert "reward 0.700 [0.600, 0.800]" in text and "greedy 0.800 [0.700, 0.900]" in text
    assert "correct_answer mean 0.300 [0.200, 0.400]" in text and "correct_answer greedy" not in text
