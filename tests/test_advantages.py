"""compute_advantages: weighted rewards with None/NaN, group/batch/none scaling, GDPO, unscorable
rows; checked by hand and against a float64 re-derivation built on the statistics module."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from grpo_plugins.advantages import AdvantageError, combine_rewards, compute_advantages, nan_std
from grpo_plugins.registry import UnknownComponentError, get_registry

NAN = float("nan")
EPS = 1e-4


def adv(rows: list[list[float]], g: int, **kw) -> list[float]:
    return compute_advantages(torch.tensor(rows, dtype=torch.float64), num_generations=g, **kw).tolist()


# -- by hand -----------------------------------------------------------------------------------


def test_group_scaling_by_hand():
    # rewards 1, 2, 3: mean 2, sample std 1 -> (-1, 0, 1) / (1 + 1e-4)
    assert adv([[1.0], [2.0], [3.0]], 3) == pytest.approx([-1 / (1 + EPS), 0.0, 1 / (1 + EPS)])


def test_groups_are_consecutive_rows():
    # two groups of two: (0, 2) and (10, 10)
    s = math.sqrt(2.0)
    assert adv([[0.0], [2.0], [10.0], [10.0]], 2) == pytest.approx([-1 / (s + EPS), 1 / (s + EPS), 0.0, 0.0])


def test_weighted_sum_of_rewards():
    # R = 1*r1 + 0.5*r2 = (2, 1, 0); mean 1, std 1
    rows = [[1.0, 2.0], [0.0, 2.0], [0.0, 0.0]]
    assert adv(rows, 3, reward_weights=[1.0, 0.5]) == pytest.approx([1 / (1 + EPS), 0.0, -1 / (1 + EPS)])


def test_none_rewards_are_skipped_in_the_sum():
    # row 0: 3 + (skipped) = 3; row 1: 1 + 2 = 3 -> zero spread, both 0
    assert adv([[3.0, NAN], [1.0, 2.0]], 2) == [0.0, 0.0]
    assert combine_rewards(torch.tensor([[3.0, NAN], [1.0, 2.0]])).tolist() == [3.0, 3.0]


def test_unscorable_row_is_excluded_from_its_group_and_gets_zero():
    # group (1, 3, None): stats over (1, 3) only -> mean 2, std sqrt(2); the None row gets 0
    s = math.sqrt(2.0)
    assert adv([[1.0], [3.0], [NAN]], 3) == pytest.approx([-1 / (s + EPS), 1 / (s + EPS), 0.0])


def test_group_where_every_reward_is_none():
    out = adv([[NAN, NAN], [NAN, NAN], [1.0, 0.0], [0.0, 0.0]], 2)
    assert out[:2] == [0.0, 0.0]
    assert out[2:] == pytest.approx([1 / (math.sqrt(0.5) + EPS) * 0.5, -1 / (math.sqrt(0.5) + EPS) * 0.5])


def test_zero_std_group_gives_zero_advantages():
    for scale in ("group", "batch", "none"):
        assert adv([[5.0], [5.0], [5.0]], 3, scale_rewards=scale) == [0.0, 0.0, 0.0]


def test_single_scorable_row_in_a_group_gets_zero_not_nan():
    assert adv([[4.0], [NAN], [NAN]], 3) == [0.0, 0.0, 0.0]


def test_batch_scaling_divides_by_the_batch_std():
    rows = [[0.0], [2.0], [10.0], [14.0]]
    batch_std = statistics.stdev([0.0, 2.0, 10.0, 14.0])
    expected = [-1 / (batch_std + EPS), 1 / (batch_std + EPS), -2 / (batch_std + EPS), 2 / (batch_std + EPS)]
    assert adv(rows, 2, scale_rewards="batch") == pytest.approx(expected)


def test_none_scaling_only_centres():
    assert adv([[0.0], [2.0], [10.0], [14.0]], 2, scale_rewards="none") == pytest.approx([-1.0, 1.0, -2.0, 2.0])


def test_boolean_scale_rewards_are_read_by_the_config_not_by_compute_advantages():
    from grpo_plugins.config import GRPOConfig

    rows = [[0.0], [2.0], [10.0], [14.0]]
    assert adv(rows, 2, scale_rewards=GRPOConfig(scale_rewards=True).scale_rewards) == adv(rows, 2, scale_rewards="group")
    assert adv(rows, 2, scale_rewards=GRPOConfig(scale_rewards=False).scale_rewards) == adv(rows, 2, scale_rewards="none")
    with pytest.raises(AdvantageError, match="'group', 'batch' or 'none', not True"):
        adv(rows, 2, scale_rewards=True)


# -- float64 re-derivation -----------------------------------------------------------------------


def reference_advantages(rows: list[list[float]], g: int, weights: list[float], scale: str) -> list[float]:
    combined = []
    for row in rows:
        present = [w * r for w, r in zip(weights, row) if not math.isnan(r)]
        combined.append(sum(present) if present else None)
    scorable = [r for r in combined if r is not None]
    batch_std = statistics.stdev(scorable) if len(scorable) > 1 else 0.0
    out = []
    for start in range(0, len(rows), g):
        group = [r for r in combined[start : start + g] if r is not None]
        mean = statistics.fmean(group) if group else 0.0
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        for r in combined[start : start + g]:
            if r is None:
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (std + EPS))
            elif scale == "batch":
                out.append((r - mean) / (batch_std + EPS))
            else:
                out.append(r - mean)
    return out


def reference_gdpo(rows: list[list[float]], g: int, weights: list[float]) -> list[float]:
    k = len(rows[0])
    normed = [[NAN] * k for _ in rows]
    for start in range(0, len(rows), g):
        for j in range(k):
            values = [rows[i][j] for i in range(start, start + g) if not math.isnan(rows[i][j])]
            if not values:
                continue
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            for i in range(start, start + g):
                if not math.isnan(rows[i][j]):
                    normed[i][j] = (rows[i][j] - mean) / (std + EPS)
    combined = []
    for raw, row in zip(rows, normed):
        if all(math.isnan(r) for r in raw):
            combined.append(None)
        else:
            combined.append(sum(w * r for w, r in zip(weights, row) if not math.isnan(r)))
    scorable = [r for r in combined if r is not None]
    mean = statistics.fmean(scorable)
    std = statistics.stdev(scorable) if len(scorable) > 1 else 0.0
    return [0.0 if r is None else (r - mean) / (std + EPS) for r in combined]


def random_rewards(seed: int, n: int = 12, k: int = 3) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, k, generator=g, dtype=torch.float64)
    values[torch.rand(n, k, generator=g) < 0.25] = NAN
    values[5] = NAN  # one unscorable row
    values[8:12] = NAN  # one whole group of None
    values[8, 0] = 1.0  # ... but for one value
    return values.tolist()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_sum_then_normalize_matches_reference(scale, seed):
    rows, weights = random_rewards(seed), [1.0, 0.5, 2.0]
    expected = reference_advantages(rows, 4, weights, scale)
    assert adv(rows, 4, reward_weights=weights, scale_rewards=scale) == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_normalize_then_sum_matches_reference(seed):
    rows, weights = random_rewards(seed), [1.0, 0.5, 2.0]
    out = adv(rows, 4, reward_weights=weights, multi_objective_aggregation="normalize_then_sum")
    assert out == pytest.approx(reference_gdpo(rows, 4, weights), rel=1e-9, abs=1e-9)


def test_gdpo_by_hand():
    # reward 1 in a group: (0, 2) -> (-1, 1)/(sqrt2 + eps); reward 2: (5, 5) -> (0, 0)
    # sums: -a, a with a = 1/(sqrt2+eps); batch standardisation: (-a, a) / (std + eps), std = a*sqrt2
    a = 1 / (math.sqrt(2) + EPS)
    s = a * math.sqrt(2)
    out = adv([[0.0, 5.0], [2.0, 5.0]], 2, multi_objective_aggregation="normalize_then_sum")
    assert out == pytest.approx([-a / (s + EPS), a / (s + EPS)])


def test_nan_std_is_bessel_corrected_and_never_nan():
    x = torch.tensor([[1.0, 2.0, 4.0, NAN], [NAN, 3.0, NAN, NAN], [NAN] * 4], dtype=torch.float64)
    assert nan_std(x, dim=1).tolist() == pytest.approx([statistics.stdev([1.0, 2.0, 4.0]), 0.0, 0.0])
    assert nan_std(x).item() == pytest.approx(statistics.stdev([1.0, 2.0, 4.0, 3.0]))


def test_float32_rewards_keep_their_dtype_and_ints_become_float():
    out = compute_advantages(torch.tensor([[1], [0]]), num_generations=2)
    assert out.dtype == torch.float32 and out.tolist() == pytest.approx([1 / (math.sqrt(0.5) + EPS) * 0.5, -0.5 / (math.sqrt(0.5) + EPS)])


# -- components and errors -----------------------------------------------------------------------


def test_a_plugin_scaling_is_found_by_name():
    class RankScaling:
        """Advantage = the reward's rank within its group, centred."""

        def advantages(self, rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
            ranks = rewards.view(-1, num_generations).argsort(dim=1).argsort(dim=1).to(rewards.dtype)
            return (ranks - ranks.mean(dim=1, keepdim=True)).view(-1)

    with get_registry().temporary("reward_scaling", "rank", RankScaling):
        assert adv([[10.0], [-3.0], [7.0]], 3, scale_rewards="rank") == [1.0, -1.0, 0.0]
    assert adv([[10.0], [-3.0], [7.0]], 3, scale_rewards=RankScaling()) == [1.0, -1.0, 0.0]


def test_nan_from_a_plugin_scaling_is_not_hidden_but_unscorable_rows_are_zero():
    class BrokenScaling:
        """Divides by the group's reward range: 0/0 for a zero-spread group."""

        def advantages(self, rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
            g = rewards.view(-1, num_generations)
            spread = g.max(dim=1, keepdim=True).values - g.min(dim=1, keepdim=True).values
            return ((g - g.mean(dim=1, keepdim=True)) / spread).view(-1)

    # group 1 has spread 2; group 2 is zero-spread (0/0 = NaN); row 4 is unscorable
    out = adv([[1.0], [3.0], [5.0], [5.0], [NAN], [0.0]], 2, scale_rewards=BrokenScaling())
    assert out[:2] == [-0.5, 0.5]
    assert math.isnan(out[2]) and math.isnan(out[3])  # the engine's guard names the scaling
    assert out[4] == 0.0


def test_errors_name_what_to_change():
    with pytest.raises(AdvantageError, match="num_generations=4"):
        adv([[1.0]] * 6, 4)
    with pytest.raises(AdvantageError, match="one weight per reward"):
        adv([[1.0, 2.0]] * 2, 2, reward_weights=[1.0])
    with pytest.raises(UnknownComponentError, match="did you mean 'group'"):
        adv([[1.0]] * 2, 2, scale_rewards="grup")
    with pytest.raises(AdvantageError, match="normalize_then_sum"):
        adv([[1.0]] * 2, 2, multi_objective_aggregation="mean")
