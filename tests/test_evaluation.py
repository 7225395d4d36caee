"""Evaluation: the pass@k estimator, the summary numbers, the Evaluator on a tiny model with
rewards whose values are known, and that evaluating never disturbs training's random streams."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.config import load_config
from grpo_plugins.episodes import build_environment
from grpo_plugins.evaluation import Evaluator, pass_at_k, summarise
from grpo_plugins.generators import build_generator
from grpo_plugins.models import load_model
from grpo_plugins.registry import get_registry
from grpo_plugins.rewards import RewardRunner

NAN = math.nan


# -- pass@k ------------------------------------------------------------------------------------------


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """Among all k-subsets of n samples (the first c correct), the fraction holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_enumeration() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_by_enumeration(n, c, k)), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_n_is_any_correct() -> None:
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 0, 8) == 0.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


# -- the summary ---------------------------------------------------------------------------------------


def test_summary_numbers_from_known_scores() -> None:
    # 2 prompts x 4 samples; rewards: a (0/1), b (0.5 everywhere: not 0/1), c (0/1, mostly None).
    a = [[1, 0, 0, 1], [0, 0, 0, 0]]
    b = [[0.5] * 4, [0.5] * 4]
    c = [[1, NAN, NAN, NAN], [0, 1, 1, 0]]
    samples = torch.tensor([[[a[p][j], b[p][j], c[p][j]] for j in range(4)] for p in range(2)])  # (2, 4, 3)
    lengths = torch.tensor([[3, 5, 7, 9], [2, 2, 2, 2]])
    truncated = torch.tensor([[False, False, False, True], [False] * 4])
    greedy = torch.tensor([[1.0, 0.5, NAN], [0.0, 0.5, 1.0]])
    result = summarise(samples, lengths, truncated, greedy, torch.tensor([4, 6]), ["a", "b", "c"], [1.0, 2.0, 1.0])

    ra, rb, rc = result.rewards
    assert (ra.mean, ra.greedy, ra.binary) == (0.25, 0.5, True)
    assert ra.pass_at == {1: pytest.approx((2 / 4 + 0) / 2), 4: pytest.approx((1 + 0) / 2)}
    assert (rb.mean, rb.binary, rb.pass_at) == (0.5, False, {})
    # c: prompt 0 has one scored sample (counts for pass@1 only), prompt 1 has four.
    assert rc.mean == pytest.approx(3 / 5)
    assert rc.pass_at == {1: pytest.approx((1 + 2 / 4) / 2), 4: pytest.approx(1.0)}
    assert rc.greedy == 1.0
    # weighted: a + 2 b + c per sample (None skipped), then the mean over samples.
    per_sample = [a[p][j] + 1.0 + (0 if math.isnan(c[p][j]) else c[p][j]) for p in range(2) for j in range(4)]
    assert result.reward == pytest.approx(sum(per_sample) / 8)
    assert result.greedy_reward == pytest.approx(((1 + 1) + (0 + 1 + 1)) / 2)
    assert result.mean_length == pytest.approx(32 / 8)
    assert result.clipped_ratio == pytest.approx(1 / 8)
    assert result.greedy_mean_length == 5.0
    metrics = result.metrics()
    assert metrics["eval/rewards/a/pass@4"] == pytest.approx(0.5)
    assert "eval/rewards/b/pass@1" not in metrics


def test_a_reward_that_scored_nothing_has_no_mean_and_no_metric() -> None:
    samples = torch.full((1, 2, 1), NAN)
    result = summarise(samples, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.bool), torch.full((1, 1), NAN), torch.ones(1), ["r"], [1.0])
    assert result.rewards[0].mean is None and result.reward is None
    assert not any(math.isnan(v) for v in result.metrics().values())
    assert "eval/rewards/r/mean" not in result.metrics()


# -- the Evaluator on a tiny model -------------------------------------------------------------------


class Quota:
    """1.0 for the first ``quota`` completions of each prompt it sees, then 0.0; records every
    completion's token ids."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.ids: list[tuple[str, list[int]]] = []

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], quota: list[int], **kw: Any) -> list[float]:
        out = []
        for p, ids, q in zip(prompts, completion_ids, quota):
            self.seen[p] = self.seen.get(p, 0) + 1
            self.ids.append((p, list(ids)))
            out.append(1.0 if self.seen[p] <= q else 0.0)
        return out


def half(completions: list[str], **kw: Any) -> list[float]:
    return [0.5] * len(completions)


ROWS = [{"prompt": "ab", "quota": 0}, {"prompt": "cde", "quota": 2}, {"prompt": "f", "quota": 4}]


def _evaluator(tiny_model: dict, rewards: list[Any], **settings: Any) -> tuple[Evaluator, Any, Any]:
    import datasets

    config = load_config({
        "model": tiny_model, "task": None, "num_generations": 4, "max_completion_length": 6,
        "per_device_eval_batch_size": 8, "seed": 5, **settings,
    })
    model, tokenizer = load_model(tiny_model, dtype="float32", seed=config.seed)
    generator = build_generator(config, get_registry(), model, tokenizer, torch.device("cpu"))
    environment = build_environment(config, get_registry(), generator, tokenizer)
    runner = RewardRunner(rewards, reward_weights=[1.0, 2.0][: len(rewards)])
    return Evaluator(config, environment, runner, datasets.Dataset.from_list(ROWS)), model, tokenizer


def test_eval_numbers_of_rewards_with_known_values(tiny_model: dict) -> None:
    quota = Quota()
    evaluator, model, tokenizer = _evaluator(tiny_model, [quota, half])
    result = evaluator.run()

    # Sampled: 4 per prompt, so `quota` scores min(quota, 4) of them: 0, 2, 4. Greedy is each
    # prompt's 5th completion: 0 everywhere.
    by_name = {r.name: r for r in result.rewards}
    q, h = by_name["Quota"], by_name["half"]
    assert (result.num_prompts, result.num_generations) == (3, 4)
    assert q.mean == pytest.approx(6 / 12)
    assert q.pass_at == {1: pytest.approx((0 + 0.5 + 1) / 3), 4: pytest.approx((0 + 1 + 1) / 3)}
    assert q.greedy == 0.0 and q.binary
    assert (h.mean, h.greedy, h.binary, h.pass_at) == (0.5, 0.5, False, {})
    assert result.reward == pytest.approx(0.5 + 2 * 0.5)
    assert result.greedy_reward == pytest.approx(0.0 + 2 * 0.5)

    # Lengths, re-derived from the token ids the reward saw (12 sampled, then 3 greedy).
    eos = tokenizer.eos_token_id
    sampled, greedy = quota.ids[:12], quota.ids[12:]
    assert [p for p, _ in sampled] == [r["prompt"] for r in ROWS for _ in range(4)]
    assert result.mean_length == pytest.approx(sum(len(ids) for _, ids in sampled) / 12)
    assert result.clipped_ratio == pytest.approx(sum(eos not in ids for _, ids in sampled) / 12)
    assert result.greedy_mean_length == pytest.approx(sum(len(ids) for _, ids in greedy) / 3)

    # The greedy completions are what transformers' own greedy decoding gives.
    for prompt, ids in greedy:
        enc = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        expected = out[0, enc["input_ids"].shape[1]:].tolist()
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert ids == expected


def test_evaluating_twice_gives_the_same_numbers_and_leaves_every_rng_as_it_was(tiny_model: dict) -> None:
    import numpy as np

    evaluator, _, _ = _evaluator(tiny_model, [half])
    evaluator.generator.calls = 7
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    first = evaluator.run()
    second = evaluator.run()
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    assert (np.random.get_state()[1] == np_state).all()
    assert evaluator.generator.calls == 7
    first.seconds = second.seconds = 0.0
    assert first == second


# -- settings ----------------------------------------------------------------------------------------


def test_eval_steps_follow_trl_a_fraction_of_the_run_or_logging_steps() -> None:
    assert load_config({"eval_steps": 5}).resolved_eval_steps(100) == 5
    assert load_config({"eval_steps": 0.25}).resolved_eval_steps(10) == 3  # ceil(2.5)
    assert load_config({"logging_steps": 4}).resolved_eval_steps(100) == 4
    assert load_config({}).resolved_num_generations_eval == 8
    assert load_config({"num_generations_eval": 3}).resolved_num_generations_eval == 3


def test_evaluating_during_training_needs_eval_prompts() -> None:
    from grpo_plugins.config import ConfigError
    from grpo_plugins.testing import registered_component
    from grpo_plugins.validation import validate_config

    validate_config({"eval_strategy": "steps"})  # arithmetic has a held-out split
    with pytest.raises(ConfigError, match="eval_dataset: eval_strategy: steps needs prompts to evaluate on: training uses dataset:"):
        validate_config({"eval_strategy": "steps", "dataset": {"path": "json", "data_files": __file__}})

    class NoSplit:
        default_rewards = ["correct_answer"]

        def load(self, seed: int) -> Any:
            raise AssertionError("validate must not load data")

    with registered_component("task", NoSplit, "no_split"):
        with pytest.raises(ConfigError, match="task 'no_split' has no held-out split"):
            validate_config({"eval_strategy": "steps", "task": "no_split"})
        validate_config({"eval_strategy": "steps", "task": "no_split", "eval_dataset": {"path": "json", "data_files": __file__}})


def test_eval_steps_without_eval_strategy_warns() -> None:
    from grpo_plugins.validation import ConfigWarning, validate_config

    with pytest.warns(ConfigWarning, match="no effect while eval_strategy is 'no'"):
        validate_config({"eval_steps": 10})


def test_eval_line_shows_each_reward_with_pass_at_k_and_greedy() -> None:
    from grpo_plugins.metrics import eval_line

    metrics = {
        "eval/reward": 0.75, "eval/rewards/ok/mean": 0.5, "eval/rewards/ok/pass@1": 0.5, "eval/rewards/ok/pass@8": 0.9,
        "eval/rewards/ok/greedy": 1.0, "eval/completions/mean_length": 12.25, "eval/seconds": 3.0,
    }
    assert eval_line(7, metrics) == "eval step 7 | reward 0.750 | ok 0.500 pass@1 0.500 pass@8 0.900 greedy 1.000 | len 12.2 | 3.0 s"
