"""How compute_loss finds its components, what a plugin must write, settings errors, and the
exact merging of LossMetrics across micro-batches and processes."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_plugins
from grpo_plugins.config import ComponentRef
from grpo_plugins.kinds import ImportanceSampling, LossInputs, LossType
from grpo_plugins.objective import LossMetrics, LossSettingsError, Objective, compute_loss
from grpo_plugins.registry import UnknownComponentError, get_registry

ROOT = Path(__file__).resolve().parents[1]


def batch(seed: int = 0, B: int = 3, T: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0][:B], dtype=torch.float64)
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    return logp, old, adv, mask


# -- writing a component ---------------------------------------------------------------------


class SequenceSum(LossType):
    """A normalisation-only loss type: token sum per sequence, mean over sequences."""

    def reduce(self, per_token_loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        per_sequence = (per_token_loss * inputs.mask).sum(-1)  # (B,)
        return per_sequence.mean() / inputs.gradient_accumulation_steps


class Reinforce(LossType):
    """A surrogate change: plain -A·logp, token-mean reduction (as bnpo)."""

    def per_token_loss(self, inputs: LossInputs) -> torch.Tensor:
        return -inputs.advantages * inputs.per_token_logps

    def reduce(self, per_token_loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return (per_token_loss * inputs.mask).sum() / inputs.mask.sum().clamp(min=1.0)


class MaxLevel(ImportanceSampling):
    """One ratio per sequence from its largest token log-ratio."""

    def log_weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return log_ratio.masked_fill(mask == 0, -1e9).amax(-1, keepdim=True).clamp(min=-50)


def test_normalisation_only_loss_type_plugin():
    logp, old, adv, mask = batch()
    with get_registry().temporary("loss_type", "sequence_sum", SequenceSum):
        loss, _ = compute_loss(logp, old, adv, mask, loss_type="sequence_sum")
    grpo, _ = compute_loss(logp, old, adv, mask, loss_type="grpo")
    # grpo divides each row by its length: 4, 2, 4 tokens
    lengths = mask.sum(-1)
    per_token = -torch.min((logp - old).exp() * adv[:, None], (logp - old).exp().clamp(0.8, 1.2) * adv[:, None])
    torch.testing.assert_close(loss, ((per_token * mask).sum(-1)).mean())
    torch.testing.assert_close(grpo, ((per_token * mask).sum(-1) / lengths).mean())


def test_surrogate_loss_type_plugin_and_importance_sampling_plugin():
    logp, old, adv, mask = batch()
    loss, _ = compute_loss(logp, old, adv, mask, loss_type=Reinforce())
    torch.testing.assert_close(loss, (-adv[:, None] * logp * mask).sum() / mask.sum())
    with get_registry().temporary("importance_sampling", "max", MaxLevel):
        _, metrics = compute_loss(logp, old, adv, mask, loss_type="bnpo", importance_sampling_level="max")
    ratio = (logp - old).masked_fill(mask == 0, -1e9).amax(-1).exp()
    high = ((ratio > 1.2) & (adv > 0)).double().mean().item()
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high)  # per-sequence metric: averaged over rows


def test_decorator_registration_is_found():
    @grpo_plugins.loss_type("test_token_sum")
    class TokenSum(LossType):
        def reduce(self, per_token_loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
            return (per_token_loss * inputs.mask).sum()

    try:
        logp, old, adv, mask = batch()
        loss, _ = compute_loss(logp, old, adv, mask, loss_type="test_token_sum")
        dapo, _ = compute_loss(logp, old, adv, mask, loss_type="dapo")
        torch.testing.assert_close(loss, dapo * mask.sum())
    finally:
        get_registry().unregister("loss_type", "test_token_sum")


def test_component_spellings_are_equivalent():
    logp, old, adv, mask = batch()
    params = {"temperature_pos": 0.5, "temperature_neg": 2.0}
    spellings = [
        {"name": "sapo", "params": params},
        ComponentRef(name="sapo", params=params),
        get_registry().build("loss_type", "sapo", params),
    ]
    losses = [compute_loss(logp, old, adv, mask, loss_type=s)[0] for s in spellings]
    assert losses[0] == losses[1] == losses[2]
    assert losses[0] != compute_loss(logp, old, adv, mask, loss_type="sapo")[0]
    qualified, _ = compute_loss(logp, old, adv, mask, loss_type="grpo-plugins:grpo")
    assert qualified == compute_loss(logp, old, adv, mask, loss_type="grpo")[0]


def test_settings_errors_are_clear():
    logp, old, adv, mask = batch()
    with pytest.raises(LossSettingsError, match="did you mean 'epsilon_high'"):
        compute_loss(logp, old, adv, mask, epsilon_hgh=0.3)
    with pytest.raises(UnknownComponentError, match="did you mean 'dapo'"):
        compute_loss(logp, old, adv, mask, loss_type="dapoo")
    with pytest.raises(LossSettingsError, match="ref_per_token_logps"):
        compute_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(LossSettingsError, match="sampling_per_token_logps"):
        compute_loss(logp, old, adv, mask, vllm_importance_sampling_correction=True)
    with pytest.raises(grpo_plugins.GRPOPluginsError, match="max_completion_length"):
        compute_loss(logp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(LossSettingsError, match=r"\(B, T\)"):
        compute_loss(logp[0], old, adv, mask)
    with pytest.raises(UnknownComponentError, match="rollout_correction"):
        compute_loss(logp, old, adv, mask, sampling_per_token_logps=old, rollout_correction="nope")


def test_the_objective_of_a_config_builds_its_components_and_feeds_compute_loss():
    from grpo_plugins.config import GRPOConfig

    config = GRPOConfig(loss_type="bnpo", epsilon_high=0.28, beta=0.01, max_completion_length=16)
    objective = Objective.from_config(config)
    assert type(objective.loss_type) is type(get_registry().build("loss_type", "bnpo"))
    assert objective.resolved_epsilon_high == 0.28
    logp, old, adv, mask = batch()
    loss, metrics = compute_loss(logp, old, adv, mask, ref_per_token_logps=old, objective=objective)
    assert math.isfinite(loss.item()) and "kl" in metrics
    keywords = dict(loss_type="bnpo", epsilon_high=0.28, beta=0.01, max_completion_length=16)
    same, _ = compute_loss(logp, old, adv, mask, ref_per_token_logps=old, **keywords)
    assert torch.equal(loss, same)


def test_an_objective_and_the_same_keyword_settings_give_the_same_loss_and_gradient():
    logp, old, adv, mask = batch()
    settings = dict(loss_type="sapo", importance_sampling_level="sequence", epsilon=0.1, beta=0.02,
                    vllm_importance_sampling_correction=True, rollout_correction="sequence_truncate")
    inputs = dict(ref_per_token_logps=old + 0.1, sampling_per_token_logps=old - 0.2)
    results = []
    for kw in (settings, {"objective": Objective(**settings)}):
        x = logp.clone().requires_grad_()
        loss, metrics = compute_loss(x, old, adv, mask, **inputs, **kw)
        results.append((loss, torch.autograd.grad(loss, x)[0], dict(metrics)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]
    # No settings at all: Objective()'s defaults.
    assert torch.equal(compute_loss(logp, old, adv, mask)[0], compute_loss(logp, old, adv, mask, objective=Objective())[0])


def test_an_objective_holds_built_components_and_replace_keeps_them():
    objective = Objective(loss_type={"name": "sapo", "params": {"temperature_pos": 0.5}})
    assert type(objective.loss_type) is type(get_registry().build("loss_type", "sapo"))
    assert objective.loss_type.params.temperature_pos == 0.5
    assert type(objective.rollout_correction) is type(get_registry().build("rollout_correction", "token_truncate"))
    variant = dataclasses.replace(objective, entropy_coef=0.01)
    assert variant.loss_type is objective.loss_type and variant.entropy_coef == 0.01
    assert objective.entropy_coef == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        objective.beta = 0.1  # type: ignore[misc]


def test_an_objective_checks_its_values_once_and_refuses_settings_beside_it():
    with pytest.raises(LossSettingsError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        Objective(top_entropy_quantile=1.5)
    with pytest.raises(LossSettingsError, match="true, false or 'auto'"):
        Objective(vllm_importance_sampling_correction="yes")  # type: ignore[arg-type]
    logp, old, adv, mask = batch()
    with pytest.raises(LossSettingsError, match="objective= and the settings beta"):
        compute_loss(logp, old, adv, mask, objective=Objective(), beta=0.1)


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_merge_equals_metrics_of_the_concatenated_batch():
    logp, old, adv, mask = batch(B=3, T=5)
    sampling = old - 0.5 * torch.rand_like(old)
    kw = dict(ref_per_token_logps=old + 0.1, sampling_per_token_logps=sampling, beta=0.1, loss_type="dapo")
    _, whole = compute_loss(logp, old, adv, mask, **kw)
    parts = [
        compute_loss(logp[r], old[r], adv[r], mask[r], **{**kw, "ref_per_token_logps": (old + 0.1)[r],
                                                         "sampling_per_token_logps": sampling[r]})[1]
        for r in (slice(0, 1), slice(1, 3))
    ]
    merged = LossMetrics.merge(parts)
    assert set(merged) == set(whole)
    for name in whole:
        assert merged[name] == pytest.approx(whole[name], rel=1e-6), name


def test_metrics_all_reduce_uses_sums_counts_and_extrema():
    a = LossMetrics.from_parts({"kl": (torch.tensor(3.0), torch.tensor(2.0))}, {"m/min": torch.tensor(0.5)}, {"m/max": torch.tensor(1.5)})
    b = LossMetrics.from_parts({"kl": (torch.tensor(1.0), torch.tensor(2.0))}, {"m/min": torch.tensor(0.25)}, {"m/max": torch.tensor(4.0)})

    class TwoProcesses:
        """Stands in for an Accelerator whose other process holds ``b``."""

        num_processes = 2
        peer = {a.sums.data_ptr(): b.sums, a.counts.data_ptr(): b.counts, a.mins.data_ptr(): b.mins,
                a.maxs.data_ptr(): b.maxs}

        def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
            assert reduction == "sum"
            return tensor + self.peer[tensor.data_ptr()]

        def gather(self, tensor: torch.Tensor) -> torch.Tensor:  # (1, E) per process -> (2, E)
            return torch.cat([tensor, self.peer[tensor.data_ptr()].unsqueeze(0)])

    acc = TwoProcesses()
    reduced = a.all_reduce(acc)
    assert dict(reduced) == {"kl": 1.0, "m/min": 0.25, "m/max": 4.0}
    assert a.all_reduce(type("One", (), {"num_processes": 1})()) is a


def test_empty_metrics_read_zero():
    m = LossMetrics.from_parts(
        {"kl": (torch.tensor(0.0), torch.tensor(0.0))},
        {"x/min": torch.tensor(float("inf"))},
        {"x/max": torch.tensor(float("-inf"))},
    )
    assert dict(m) == {"kl": 0.0, "x/min": 0.0, "x/max": 0.0}


# -- the core stays generic and fast to import ---------------------------------------------------


def test_core_knows_no_component_by_name():
    for module in ("objective.py", "advantages.py"):
        tree = ast.parse((ROOT / "grpo_plugins" / module).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.startswith("builtin_") for name in imported), module
        compared = [
            node for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value in {"grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo",
                                                                 "token", "sequence", "group", "batch"}
                    for c in [node.left, *node.comparators])
        ]
        assert not compared, f"{module} compares against a component name"


def test_builtin_losses_register_without_importing_torch():
    code = (
        "import sys, builtin_losses; assert 'torch' not in sys.modules, 'torch imported';"
        "from grpo_plugins.registry import get_registry; r = get_registry();"
        "assert {'grpo','bnpo','dr_grpo','dapo','cispo','sapo'} <= set(r.names('loss_type'));"
        "assert {'token','sequence'} <= set(r.names('importance_sampling'));"
        "assert {'group','batch','none'} <= set(r.names('reward_scaling'));"
        "assert {'token_truncate','token_mask','sequence_truncate','sequence_mask'} <= set(r.names('rollout_correction'));"
        "assert 'torch' not in sys.modules, 'torch imported by registration'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_public_api_names():
    from grpo_plugins.advantages import compute_advantages
    from grpo_plugins.objective import compute_loss as core_compute_loss

    assert grpo_plugins.compute_loss is core_compute_loss
    assert grpo_plugins.compute_advantages is compute_advantages


def test_builtin_losses_pass_the_component_contract_checker():
    import builtin_losses
    from grpo_plugins.testing import check_plugin

    components = check_plugin(builtin_losses)
    assert len(components) == 8 + 2 + 3 + 4 + 3


def test_dapo_accepts_a_plain_number_of_items_in_loss_inputs():
    logp, old, adv, mask = batch()
    as_number, _ = compute_loss(logp, old, adv, mask, loss_type="dapo", num_items_in_batch=20)
    as_tensor, _ = compute_loss(logp, old, adv, mask, loss_type="dapo", num_items_in_batch=torch.tensor(20))
    assert as_number == as_tensor
