"""The engine's metric helpers and checkpoint bookkeeping (no model, milliseconds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_plugins.checkpoint import CheckpointError, STATE_FILE, latest_checkpoint, list_checkpoints, resolve_resume
from grpo_plugins.policy import trim_padding
from grpo_plugins.prompts import PromptStream
from grpo_plugins.rollout import accumulation_windows
from grpo_plugins.batching import make_plan
from grpo_plugins.metrics import average, completion_metrics, read_metrics, reward_metrics, truncate_jsonl


def test_reward_metrics_follow_trl() -> None:
    # Two groups of 2; reward b is None (NaN) for the first row.
    rewards = torch.tensor([[1.0, float("nan")], [3.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    m = reward_metrics(rewards, ["a", "b"], [1.0, 0.5], num_generations=2)
    combined = [1.0, 3.5, 3.0, 3.0]
    assert m["reward"] == pytest.approx(sum(combined) / 4)
    assert m["reward_std"] == pytest.approx((math.sqrt(((1 - 2.25) ** 2 + (3.5 - 2.25) ** 2) / 1) + 0.0) / 2)
    assert m["frac_reward_zero_std"] == 0.5
    assert m["rewards/a/mean"] == 2.0
    assert m["rewards/b/mean"] == pytest.approx(5 / 3)  # the None is skipped, not counted as 0
    assert m["rewards/b/std"] == pytest.approx(torch.tensor([1.0, 2.0, 2.0]).std().item())


def test_reward_metrics_never_nan() -> None:
    m = reward_metrics(torch.full((4, 1), float("nan")), ["a"], [1.0], num_generations=2)
    assert all(math.isfinite(v) for v in m.values())


def test_completion_metrics() -> None:
    m = completion_metrics(torch.tensor([4, 8, 2, 8]), torch.tensor([False, True, False, True]))
    assert m == {
        "completions/mean_length": 5.5,
        "completions/min_length": 2.0,
        "completions/max_length": 8.0,
        "completions/clipped_ratio": 0.5,
        "completions/mean_terminated_length": 3.0,
    }
    all_cut = completion_metrics(torch.tensor([8, 8]), torch.tensor([True, True]))
    assert all_cut["completions/mean_terminated_length"] == 0.0


def test_average_keeps_last_value_of_states() -> None:
    window = [{"loss": 1.0, "num_tokens": 10.0, "learning_rate": 0.1}, {"loss": 3.0, "num_tokens": 25.0, "learning_rate": 0.05}]
    assert average(window) == {"loss": 2.0, "num_tokens": 25.0, "learning_rate": 0.05}


def test_truncate_jsonl_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    truncate_jsonl(path, 3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_half_written_checkpoints_are_never_picked(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step, complete in ((2, True), (4, True), (6, False)):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        if complete:
            (d / STATE_FILE).write_text("{}")
    (root / ".tmp-checkpoint-8").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert latest_checkpoint(tmp_path) == root / "checkpoint-4"
    assert resolve_resume(True, tmp_path) == root / "checkpoint-4"
    assert resolve_resume(str(root / "checkpoint-2"), tmp_path / "elsewhere") == root / "checkpoint-2"
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_resume(True, tmp_path / "empty")


def test_prompt_stream_is_a_seeded_permutation_per_epoch() -> None:
    stream = PromptStream(5, seed=1)
    first = [stream.row(i) for i in range(5)]
    second = [stream.row(i) for i in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5))
    assert first != second  # a fresh order each epoch
    assert [PromptStream(5, seed=1).row(i) for i in range(10)] == first + second


def test_windows_group_micro_steps_by_optimizer_update() -> None:
    plan = make_plan(3, 2, 3, steps_per_generation=4)
    assert accumulation_windows(plan.cycle(0)) == [0, 0, 1, 1]


def test_trim_drops_all_padding_columns() -> None:
    # (B=2, P=3 + T=4): prompt padding in column 0 for both rows; completions of length 2 and 1.
    ids = torch.arange(14).view(2, 7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]])
    out_ids, out_mask, t = trim_padding(ids, mask, 4)
    assert t == 2
    assert out_ids.tolist() == [[1, 2, 3, 4], [8, 9, 10, 11]]
    assert out_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]


def test_trim_to_a_multiple_reuses_then_adds_left_padding() -> None:
    ids = torch.arange(14).view(2, 7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]])
    out_ids, out_mask, t = trim_padding(ids, mask, 4, multiple=5)  # 4 kept columns + the 1 padding column
    assert t == 2 and out_ids.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]
    assert out_mask.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    out_ids, out_mask, t = trim_padding(ids, mask, 4, multiple=8)  # needs 3 new padding columns
    assert out_ids.shape == (2, 8) and out_ids[:, :3].eq(0).all() and out_ids[:, 3:].tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]
    assert out_mask.sum(1).tolist() == mask[:, :6].sum(1).tolist() and out_mask[:, :4].eq(0).all()


def test_compiled_layers_with_padding_to_a_multiple_give_the_eager_logps(tiny_model: dict) -> None:
    """Extra left padding changes no log-prob: positions count only attended tokens."""
    from grpo_plugins.logprobs import completion_logps
    from grpo_plugins.models import load_model

    model, _ = load_model(tiny_model, dtype="float32", seed=0)
    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [0, 0, 5, 6, 7, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    plain = completion_logps(model, *trim_padding(ids, mask, 2)[:2], 2)[0]
    padded = completion_logps(model, *trim_padding(ids, mask, 2, multiple=8)[:2], 2)[0]
    torch.testing.assert_close(plain[0], padded[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(plain[1, :1], padded[1, :1], atol=1e-6, rtol=1e-6)


def test_without_a_terminal_each_logged_step_is_one_compact_line(tmp_path, capsys) -> None:
    from grpo_plugins.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, [], total_steps=4, interactive=False)
    for step in (1, 2):
        writer.log(step, {
            "reward": 0.5 * step, "rewards/correct_answer/mean": 0.25 * step, "rewards/format/mean": 1.0,
            "kl": 0.0012, "completions/mean_length": 42.0, "timing/step": 0.8,
        })
    writer.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("step 2/4 | reward 1.000 | correct_answer 0.500 format 1.000 | kl 0.0012 | len 42.0 | 0.80 s/step | ETA ")
    assert "\x1b" not in "".join(lines)  # no terminal control sequences in a log file


def test_in_a_terminal_the_live_bar_prints_no_lines(tmp_path, capsys) -> None:
    from grpo_plugins.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, [], total_steps=4, interactive=True)
    writer.log(1, {"reward": 0.5})
    writer.close()
    assert "step 1/4" not in capsys.readouterr().out
