"""compute_loss against TRL's own GRPOTrainer._compute_loss (TRL 1.16, installed by the dev
extra: ``pip install -e '.[dev]'``, which scripts/setup.sh runs). Not skipped when trl is
missing: the comparison is the point."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_plugins.objective import compute_loss

from trl.trainer import grpo_trainer  # noqa: E402 - the dev extra installs trl
pytestmark = pytest.mark.slow

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
GA, MAX_LEN = 2, 7


class _FakeAccelerator:
    num_processes = 1

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1)


def _trl_loss(batch: dict, *, loss_type: str, level: str, delta: float | None, beta: float, is_ratio: torch.Tensor | None,
              eps_high: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logp = batch["logp"].clone().requires_grad_(True)
    B, T = logp.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, sapo_temperature_pos=1.0,
                             sapo_temperature_neg=1.05, steps_per_generation=GA),
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=eps_high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=GA,
        accelerator=_FakeAccelerator(),
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        max_completion_length=MAX_LEN,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["adv"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        # TRL's num_items_in_batch spans the generation batch (steps_per_generation micro-batches).
        # With steps_per_generation == GA it equals our window count.
        "num_items_in_batch": torch.tensor(float(batch["window"])),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logp.grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _batch() -> dict:
    g = torch.Generator().manual_seed(11)
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.9, -1.2, 0.3, -0.4], dtype=torch.float64)
    return {"logp": logp, "old": old, "ref": ref, "sampling": sampling, "adv": adv, "mask": mask, "window": 23}


@pytest.mark.parametrize(
    ("loss_type", "level", "delta", "beta", "tis"),
    list(itertools.product(LOSS_TYPES, ["token", "sequence"], [None, 1.5], [0.0, 0.05], [False, True])),
)
def test_matches_trl(loss_type, level, delta, beta, tis):
    b = _batch()
    eps_high = 1.1 if loss_type == "cispo" else 0.28
    cap = 1.8
    # TRL computes the token_truncate ratio when it generates; these are its formulas.
    is_ratio = ((b["old"] - b["sampling"]) * b["mask"]).exp().clamp(max=cap) if tis else None
    expected, expected_grad, trl_metrics = _trl_loss(b, loss_type=loss_type, level=level, delta=delta, beta=beta,
                                                     is_ratio=is_ratio, eps_high=eps_high)
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = compute_loss(
        logp, b["old"], b["adv"], b["mask"], ref_per_token_logps=b["ref"],
        sampling_per_token_logps=b["sampling"] if tis else None,
        loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=eps_high, delta=delta,
        beta=beta, max_completion_length=MAX_LEN, vllm_importance_sampling_cap=cap,
        num_items_in_batch=b["window"], gradient_accumulation_steps=GA,
    )
    loss.backward()
    # TRL builds sapo's temperatures with torch.where on Python floats, i.e. in float32 (1.05 ->
    # 1.0499999523); ours stay float64. That is the only difference, well inside SPEC's 1e-6.
    tol = 1e-6 if loss_type == "sapo" else 1e-9
    torch.testing.assert_close(loss.detach(), expected, rtol=tol, atol=1e-12)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=tol, atol=1e-12)
    for name, value in trl_metrics.items():
        if name in metrics:
            assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
