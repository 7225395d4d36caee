"""float8 decoding in the ``static`` generator: float8 copies of the merged projection weights
stay close to the 16-bit product, sample a near neighbour of the policy, and turn the rollout
correction on (the sampler is no longer exactly the trained policy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_plugins.generators.static_cache import StaticCacheGenerator
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.generators.static_layers import FusedLinear, quantize_rows
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 40]]


def test_row_quantisation_keeps_float8_precision_per_row() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]  # rows six decades apart
    x8, scale = quantize_rows(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = x8.float() * scale
    # e4m3 keeps 3 mantissa bits: relative error at most 2**-4 for every row, whatever its size.
    assert float(((back - x).abs() / x.abs().clamp(min=1e-30)).max()) <= 2**-4 + 1e-6
    assert torch.equal(x8.float().abs().amax(-1), torch.full((6,), 448.0))  # each row uses the full range


def test_fused_float8_linear_matches_the_16_bit_product_within_float8_error() -> None:
    torch.manual_seed(0)
    q, k = torch.nn.Linear(64, 48, bias=True), torch.nn.Linear(64, 16, bias=True)
    exact, fp8 = FusedLinear([q, k]), FusedLinear([q, k], fp8=True)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.element_size() == 1
    x = torch.randn(3, 5, 64)
    want, got = exact(x), fp8(x)
    assert got.shape == want.shape == (3, 5, 64)
    err = float((got - want).norm() / want.norm())
    assert 1e-4 < err < 0.05  # float8, not a copy of the 16-bit weights, and close to them
    # An in-place weight update reaches the float8 copy on refresh.
    with torch.no_grad():
        q.weight.mul_(2)
        k.weight.mul_(2)
        q.bias.mul_(2)
        k.bias.mul_(2)
    fp8.refresh()
    torch.testing.assert_close(fp8(x), 2 * got, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def lora_qwen2(tiny_qwen2: dict) -> object:
    model, _ = load_model(tiny_qwen2, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def test_float8_decoding_samples_log_probs_close_to_the_policy(lora_qwen2: object) -> None:
    sampling = SamplingSettings(max_completion_length=12, temperature=1.0)
    fp8 = StaticDecoder(lora_qwen2, sampling, [], 0, prompt_multiple=8, fp8=True)
    assert fp8.merge_weights and fp8.fp8
    torch.manual_seed(1)
    ids, mask, _, logps = fp8.generate(PROMPTS)
    # The policy's own log-probs of the float8 sampler's tokens: a teacher-forced pass.
    diffs = []
    for row, prompt in enumerate(PROMPTS):
        n = int(mask[row].sum())
        seq = torch.tensor([prompt + ids[row, :n].tolist()])
        with torch.no_grad():
            logits = lora_qwen2(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()
        policy = logits.log_softmax(-1).gather(1, ids[row, :n, None]).squeeze(1)
        diffs.append((logps[row, :n] - policy).abs())
    gap = torch.cat(diffs)
    assert float(gap.max()) > 1e-6  # a different sampler, not the policy itself
    assert float(gap.mean()) < 0.05  # but a near neighbour of it


def test_fp8_refuses_unmerged_decoding(lora_qwen2: object) -> None:
    from grpo_plugins.errors import GRPOPluginsError

    with pytest.raises(GRPOPluginsError, match="merge_weights"):
        StaticDecoder(lora_qwen2, SamplingSettings(max_completion_length=4), [], 0, fp8=True, merge_weights=False)


def test_fp8_generator_does_not_sample_from_the_policy() -> None:
    assert StaticCacheGenerator().samples_from_policy
    assert not StaticCacheGenerator(StaticCacheGenerator.Params(fp8=True)).samples_from_policy


def test_a_run_with_float8_decoding_corrects_its_rollouts(tiny_qwen2: dict, tmp_path: Path) -> None:
    from grpo_plugins.engine import Engine

    def length(completions: list, **kwargs: object) -> list[float]:
        return [float(len(c)) for c in completions]

    config = {
        "model": tiny_qwen2,
        "dtype": "float32",
        "task": None,
        "lora": {"r": 4, "target_modules": "all-linear"},
        "generator": {"name": "static", "params": {"fp8": True}},
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-3,
        "report_to": ["jsonl"],
        "seed": 0,
    }
    engine = Engine(config, rewards=[length], dataset=[{"prompt": p} for p in ["ab", "cd", "ef", "gh"]])
    engine.train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    ratios = [r[k] for r in rows for k in r if k.startswith("sampling/importance_sampling_ratio/mean")]
    assert ratios, sorted(rows[-1])  # the correction ran
    assert all(0.8 < v < 1.25 for v in ratios) and any(v != 1.0 for v in ratios)
