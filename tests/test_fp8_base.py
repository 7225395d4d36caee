"""LoRA on a float8 base (``load_in_fp8``): the frozen layers multiply in float8 both ways and
stay within float8's error of the 16-bit layers, the adapters still get their gradients, the
static generator's merged copies count as a neighbour of the policy (the rollout correction
runs), a resumed run rebuilds the same base, and the setting's mistakes name it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_plugins.config import load_config
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.fp8_base import (
    FP8_MAX,
    Float8Linear,
    float8_base,
    float8_layer_count,
    has_float8_base,
    quantize_rows,
    round_stochastically,
)
from grpo_plugins.models import load_model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_a_float8_layer_stays_within_float8_error_forward_and_backward() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).requires_grad_(False)
    layer = Float8Linear(linear)
    assert layer.weight8.element_size() == 1 and layer.weight8_t.shape == (64, 48)  # float8 bits
    assert _relative(layer.weight, linear.weight) < 0.04  # e4m3: 3 mantissa bits
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), linear(x_ref)
    assert y.shape == (3, 5, 48)
    assert 1e-4 < _relative(y, y_ref) < 0.06  # float8, not a copy of the 32-bit product
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert 1e-4 < _relative(x.grad, x_ref.grad) < 0.06
    assert not any(p.requires_grad for p in layer.parameters())  # nothing of the base trains


def test_float8_base_replaces_the_frozen_layers_of_a_lora_model_but_not_the_head(tiny_qwen2: dict) -> None:
    model, _ = load_model(tiny_qwen2, dtype="float32", lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, seed=0)
    linears = sum(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in model.modules())
    replaced = float8_base(model)
    head = model.get_output_embeddings()
    assert replaced == linears - 1 and float8_layer_count(model) == replaced  # all but the LM head
    assert type(head) is torch.nn.Linear
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.get_base_layer(), Float8Linear)  # peft's base layer
    assert isinstance(model.base_model.model.model.layers[0].mlp.up_proj, Float8Linear)  # no adapter there
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    assert float8_base(model) == 0 and has_float8_base(model)  # a second call changes nothing


def test_layers_whose_sizes_float8_products_refuse_stay_16_bit() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 24), torch.nn.Linear(24, 32)).requires_grad_(False)
    assert float8_base(net) == 1  # 24 is not a multiple of 16 (cuBLASLt's rule for float8 products)
    assert isinstance(net[0], Float8Linear) and type(net[1]) is type(net[2]) is torch.nn.Linear


def test_lora_gradients_through_a_float8_base_are_close_to_the_16_bit_ones(tiny_qwen2: dict) -> None:
    lora = {"r": 4, "target_modules": "all-linear"}
    exact, _ = load_model(tiny_qwen2, dtype="float32", lora=lora, seed=0)
    fp8, _ = load_model(tiny_qwen2, dtype="float32", lora=lora, seed=0, load_in_fp8=True)
    assert has_float8_base(fp8) and not has_float8_base(exact)
    with torch.no_grad():  # adapters that change the output, identical in both models
        theirs = dict(fp8.named_parameters())
        for name, p in exact.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
                theirs[name].copy_(p)
    ids = torch.randint(3, 100, (2, 12))
    grads = []
    for model in (exact, fp8):
        model.zero_grad()
        logits = model(input_ids=ids).logits.float()
        logits.log_softmax(-1)[..., 5].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n]))
    assert 1e-4 < _relative(grads[1], grads[0]) < 0.1


def test_a_run_on_a_float8_base_corrects_the_rollouts_of_merged_decode_copies(tiny_qwen2: dict, tmp_path: Path) -> None:
    from grpo_plugins.engine import Engine

    def length(completions: list, **kwargs: object) -> list[float]:
        return [float(len(c)) for c in completions]

    config = {
        "model": tiny_qwen2, "dtype": "bfloat16", "task": None, "load_in_fp8": True,
        "lora": {"r": 4, "target_modules": "all-linear"}, "generator": {"name": "static", "params": {"merge_weights": True}},
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
        "max_completion_length": 6, "learning_rate": 1e-3, "report_to": ["jsonl"], "seed": 0,
    }
    Engine(config, rewards=[length], dataset=[{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]).train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    ratios = [r[k] for r in rows for k in r if k.startswith("sampling/importance_sampling_ratio/mean")]
    assert ratios and any(v != 1.0 for v in ratios)  # the sampler is a neighbour, corrected
    assert all(0.8 < v < 1.25 for v in ratios)


def test_the_static_generator_samples_the_policy_only_through_the_float8_layers(tiny_qwen2: dict) -> None:
    from grpo_plugins.generators.static_cache import StaticCacheGenerator
    from grpo_plugins.kinds import SamplingSettings
    from grpo_plugins.models import load_tokenizer

    model, _ = load_model(tiny_qwen2, dtype="float32", lora={"r": 4}, seed=0, load_in_fp8=True)
    tokenizer = load_tokenizer(tiny_qwen2["tokenizer"])
    sampling = SamplingSettings(max_completion_length=4)
    merged = StaticCacheGenerator(StaticCacheGenerator.Params(merge_weights=True))
    merged.setup(model, tokenizer, sampling)
    unmerged = StaticCacheGenerator(StaticCacheGenerator.Params(merge_weights=False))
    unmerged.setup(model, tokenizer, sampling)
    assert not merged.samples_from_policy and unmerged.samples_from_policy


def test_stochastic_rounding_lands_on_a_bracketing_float8_value_and_is_exact_on_average() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(200, generator=g) * 30, torch.randn(40, generator=g) * 1e-3, torch.tensor([0.0, 448.0, -448.0, 500.0, -3.0])])
    draws = 4000
    noise = torch.rand(draws, values.numel(), generator=g)
    rounded = round_stochastically(values.expand(draws, -1), noise).float()  # (draws, n)
    clamped = values.clamp(-FP8_MAX, FP8_MAX)
    nearest = clamped.to(torch.float8_e4m3fn).float()
    # every result is the nearest float8 value or the next one on the value's other side
    low = torch.minimum(rounded.min(0).values, nearest)
    high = torch.maximum(rounded.max(0).values, nearest)
    assert bool(((low <= clamped) & (clamped <= high)).all())
    assert int(rounded.unique(dim=0).shape[0]) > 1  # the noise decides
    on_grid = clamped == nearest
    assert bool((rounded[:, on_grid] == nearest[on_grid]).all())  # representable values stay
    # exact on average (to the sampling error of 4000 draws), where nearest rounding is biased
    spacing = (high - low).clamp(min=1e-12)
    error = ((rounded.mean(0) - clamped) / spacing).abs()
    assert float(error.max()) < 0.05
    assert float(((nearest - clamped) / spacing).abs()[~on_grid].mean()) > 0.1


def test_decode_copies_over_a_float8_base_keep_updates_below_the_grid_spacing() -> None:
    from grpo_plugins.generators.static_layers import FusedLinear

    torch.manual_seed(0)
    base = Float8Linear(torch.nn.Linear(256, 96, bias=False).requires_grad_(False), noise_seed=3)
    w8, scale = base.merged_float8(None)
    assert torch.equal(w8.view(torch.uint8), base.weight8) and torch.equal(scale[:, 0], base.scale[0])  # the policy's own bits
    # an update of a fifth of the grid's spacing, as early LoRA steps make
    spacing = base.scale.t() * (base.weight8.view(torch.float8_e4m3fn).float().abs() / 8).clamp(min=2**-6)
    delta = 0.2 * spacing * torch.randn(96, 256).sign()
    delta[base.weight8.view(torch.float8_e4m3fn).float().abs() == FP8_MAX] = 0.0  # every row keeps its range
    exact = base.weight8.view(torch.float8_e4m3fn).float() * base.scale.t() + delta
    nearest8, nearest_scale = quantize_rows(exact)
    w8, scale = base.merged_float8(delta)
    def moved(q: torch.Tensor, s: torch.Tensor) -> float:  # how much of the update survives
        change = q.float() * s - base.weight8.view(torch.float8_e4m3fn).float() * base.scale.t()
        return float((change * delta).sum() / (delta * delta).sum())
    assert abs(moved(w8, scale) - 1.0) < 0.15  # kept on average
    assert abs(moved(nearest8, nearest_scale)) < 0.05  # rounding to nearest drops it
    again, _ = base.merged_float8(delta)
    assert torch.equal(again.view(torch.uint8), w8.view(torch.uint8))  # the same at every call
    # an update that outgrows a row's range widens that row's grid
    big = torch.zeros(96, 256)
    big[5, 7] = float(base.weight.float().abs()[5].max()) * 3
    w8, scale = base.merged_float8(big)
    assert scale[5, 0] > base.scale[0, 5] * 2 and torch.equal(scale[6, 0], base.scale[0, 6])
    assert not bool(w8.float().isnan().any())

    class Lora(torch.nn.Module):  # what FusedLinear reads of a peft layer over the float8 base
        def __init__(self) -> None:
            super().__init__()
            self.lora_A, self.active_adapters, self.disable_adapters, self.merged = {"a": None}, ["a"], False, False
            self.use_dora, self.lora_bias = {}, {}

        def get_base_layer(self) -> Float8Linear:
            return base

        def get_delta_weight(self, name: str) -> torch.Tensor:
            return delta

    copy = FusedLinear([Lora()], fp8=True)
    w8, scale = base.merged_float8(delta)
    assert torch.equal(copy.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(copy.scale[0], scale[:, 0])


def test_the_float8_base_is_rebuilt_bit_for_bit(tiny_qwen2: dict) -> None:
    """What resuming relies on: the same source and seed give the same float8 weights."""
    lora = {"r": 4, "target_modules": "all-linear"}
    a, _ = load_model(tiny_qwen2, dtype="bfloat16", lora=lora, seed=0, load_in_fp8=True)
    b, _ = load_model(tiny_qwen2, dtype="bfloat16", lora=lora, seed=0, load_in_fp8=True)
    buffers = dict(b.named_buffers())
    assert any(n.endswith("weight8") for n in buffers)
    for name, tensor in a.named_buffers():
        assert torch.equal(tensor, buffers[name]), name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lora": None}, "load_in_fp8 puts the frozen base in float8, which only LoRA can train"),
        ({"load_in_4bit": True}, "load_in_fp8 and load_in_4bit both quantise the base"),
        ({"generator": "vllm"}, "the vllm generator cannot take weights from a float8 base"),
    ],
)
def test_load_in_fp8_mistakes_name_the_setting(tmp_path: Path, extra: dict, message: str) -> None:
    path = tmp_path / "run.yaml"
    settings = {"model": "some/model", "load_in_fp8": True, "lora": {"r": 8}, **extra}
    path.write_text(json.dumps(settings))
    with pytest.raises(GRPOPluginsError, match=message):
        load_config(path)


def test_a_policy_trained_on_a_float8_base_evaluates_through_its_own_float8_layers(
    tiny_qwen2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the float8 learning benchmark runs after training: `grpo-plugins eval` of the last
    checkpoint, sampled from the policy itself (no merged copies)."""
    import yaml

    from grpo_plugins.cli import main
    from grpo_plugins.engine import Engine

    config = {
        "model": tiny_qwen2, "dtype": "bfloat16", "load_in_fp8": True, "lora": {"r": 4, "target_modules": "all-linear"},
        "task": {"name": "arithmetic", "params": {"num_eval_samples": 4}}, "max_prompt_length": 400,
        "generator": {"name": "static", "params": {"fp8": True}}, "output_dir": str(tmp_path / "run"),
        "max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4,
        "num_generations_eval": 2, "learning_rate": 1e-3, "save_steps": 2, "seed": 0,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    Engine(config).train()
    capsys.readouterr()
    generator = "generator={name: static, params: {merge_weights: false}}"
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "run"), "--json", "--set", generator]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"].endswith("checkpoint-2") and report["num_prompts"] == 4
    assert report["reward"] is not None and report["greedy_reward"] is not None
