"""gspo_token: the sequence ratio's value with each token's own gradient."""

from __future__ import annotations

import torch

from grpo_plugins import compute_loss
from grpo_plugins_example.importance_sampling import GSPOToken

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # (B=2, T=3)


def test_value_is_the_mean_log_ratio_of_the_sequence_on_every_token() -> None:
    log_ratio = torch.tensor([[0.3, -0.6, 0.9], [0.4, 0.0, 0.0]])
    weights = GSPOToken().log_weights(log_ratio, MASK)
    torch.testing.assert_close(weights, torch.tensor([[0.2, 0.2, 0.2], [0.4, 0.4, 0.4]]))


def test_each_token_weight_has_the_gradient_of_its_own_token() -> None:
    log_ratio = torch.tensor([[0.3, -0.6, 0.9], [0.4, 0.0, 0.0]], requires_grad=True)
    weights = GSPOToken().log_weights(log_ratio, MASK)
    weights[0, 1].backward()
    expected = torch.zeros(2, 3)
    expected[0, 1] = 1.0
    torch.testing.assert_close(log_ratio.grad, expected)


def test_with_one_advantage_per_sequence_it_matches_sequence_level_gspo() -> None:
    torch.manual_seed(0)
    old = -torch.rand(2, 3)
    shift = 0.1 * torch.randn(2, 3)
    advantages = torch.tensor([1.0, -0.5])
    results = []
    for level in ("sequence", "gspo_token"):
        logps = (old + shift).requires_grad_()
        loss, _ = compute_loss(
            logps, old, advantages, MASK, loss_type="grpo", importance_sampling_level=level
        )
        loss.backward()
        results.append((loss.detach(), logps.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
