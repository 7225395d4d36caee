"""seq_mean_token_sum: the reduction and the whole loss, checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_plugins import compute_loss
from grpo_plugins.kinds import LossInputs
from grpo_plugins_example.loss_type import SeqMeanTokenSum

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # (B=2, T=3): 2 and 1 active tokens


def inputs(mask: torch.Tensor, gradient_accumulation_steps: int = 1) -> LossInputs:
    zeros = torch.zeros_like(mask)
    return LossInputs(
        per_token_logps=zeros,
        old_per_token_logps=zeros,
        advantages=torch.zeros(mask.shape[0], 1),
        mask=mask,
        log_ratio=zeros,
        log_weights=zeros,
        ratio=torch.ones_like(mask),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


def test_reduce_sums_tokens_then_averages_sequences_then_divides_by_ga() -> None:
    per_token = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])  # 100 = masked
    # Row sums: 1 + 2 = 3 and 4; their mean 3.5; divided by GA = 2: 1.75.
    loss = SeqMeanTokenSum().reduce(per_token, inputs(MASK, gradient_accumulation_steps=2))
    assert loss.item() == pytest.approx(1.75)


def test_reduce_is_exactly_zero_when_every_token_is_masked() -> None:
    per_token = torch.full((2, 3), 5.0)
    loss = SeqMeanTokenSum().reduce(per_token, inputs(torch.zeros(2, 3)))
    assert loss.item() == 0.0


def test_on_policy_loss_and_gradient_match_a_hand_computation() -> None:
    # On-policy the ratio is 1, nothing is clipped, and per_token = -A. With A = (0.5, -2):
    # row sums -0.5*2 = -1 and 2*1 = 2, mean 0.5, GA 1: loss 0.5.
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    advantages = torch.tensor([0.5, -2.0])
    loss, _ = compute_loss(
        logps, None, advantages, MASK,
        loss_type="seq_mean_token_sum", importance_sampling_level="token",
    )
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    # d loss / d logp_t = -A_i * m_t / B (the ratio's derivative is the ratio, 1).
    expected = torch.tensor([[-0.25, -0.25, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(logps.grad, expected)


def test_off_policy_loss_clips_as_ppo_then_reduces_by_sequence() -> None:
    # Token log-ratios: row 0 (A=+1): ln 1.5 -> r 1.5, clipped to 1.2; ln 0.9 -> 0.9 (inside).
    #                   row 1 (A=-1): ln 0.5 -> r 0.5, clipped to 0.8, -min(-0.5, -0.8) = 0.8.
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    logps = old + torch.log(torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.0, 1.0]]))
    loss, _ = compute_loss(
        logps, old, torch.tensor([1.0, -1.0]), MASK,
        loss_type="seq_mean_token_sum", epsilon=0.2, gradient_accumulation_steps=2,
    )
    row0 = -min(1.5 * 1, 1.2 * 1) + -min(0.9 * 1, 0.9 * 1)  # -2.1
    row1 = -min(0.5 * -1, 0.8 * -1)  # 0.8
    assert loss.item() == pytest.approx((row0 + row1) / 2 / 2)
    assert math.isfinite(loss.item())
