"""The static generator's folded norms (grpo_plugins.generators.decode_norms): decoding with each
RMSNorm's weight folded into the merged copies samples what the unfolded merged layers sample,
follows weight updates (the norm weights included), and is refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import _interpret

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.decode_norms import inverse_rms, normed_qkv, rms_silu_mul, rms_silu_mul_torch
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.generators.static_layers import FoldedLayer, MergedLayer
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 40]]


def _model(spec: dict, lora: bool) -> torch.nn.Module:
    model, _ = load_model(spec, dtype="float32", seed=0, **({"lora": {"r": 4, "target_modules": "all-linear"}} if lora else {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random init leaves them at 1, where folding would change nothing
                p.copy_(torch.empty_like(p).normal_(1.0, 0.4))
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_folded_norms_sample_what_the_merged_layers_sample(tiny_qwen2: dict, lora: bool) -> None:
    model = _model(tiny_qwen2, lora)
    sampling = SamplingSettings(max_completion_length=8, temperature=0.8)
    folded = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4, merge_weights=True, fold_norms=True)
    merged = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4, merge_weights=True, fold_norms=False)
    for update in range(2):
        torch.manual_seed(5)
        ours = folded.generate(PROMPTS)
        torch.manual_seed(5)
        reference = merged.generate(PROMPTS)
        assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
        torch.testing.assert_close(ours[3], reference[3], atol=1e-5, rtol=1e-5)
        assert ours[1].sum() > 8  # completions, not all EOS at once
        with torch.no_grad():  # an optimizer step, in place, the norms' weights too
            for name, p in model.named_parameters():
                if "norm" in name or "lora_A" in name or (not lora and "proj" in name):
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
    assert all(isinstance(layer, FoldedLayer) for layer in folded._merged)
    assert all(isinstance(layer, MergedLayer) for layer in merged._merged)
    folded.generate(PROMPTS)  # refreshes the copies after the last update
    # The copy holds the merged q/k/v weight times the input norm's weight, column by column.
    base = model.base_model.model if lora else model
    source = base.model.layers[1]
    q = source.self_attn.q_proj
    weight = q.base_layer.weight + q.get_delta_weight("default") if lora else q.weight
    torch.testing.assert_close(
        folded._merged[1].qkv.weight[: weight.shape[0]], weight * source.input_layernorm.weight[None, :]
    )


def test_folded_norms_compile_into_one_graph_per_layer_kind(tiny_qwen2: dict) -> None:
    """The folded layer traces whole (custom ops, no residual hand-off) and samples what the
    eager folded decoder samples."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = _model(tiny_qwen2, lora=False)
    model.eval()
    sampling = SamplingSettings(max_completion_length=6, temperature=0.7)
    counter = CompileCounter()
    compiled = StaticDecoder(model, sampling, [2], 0, compile=True, compile_backend=counter, prompt_multiple=4, merge_weights=True, fold_norms=True)
    eager = StaticDecoder(model, sampling, [2], 0, compile=False, prompt_multiple=4, merge_weights=True, fold_norms=True)
    torch.manual_seed(3)
    ours = compiled.generate(PROMPTS)
    torch.manual_seed(3)
    reference = eager.generate(PROMPTS)
    assert torch.equal(ours[0], reference[0])
    torch.testing.assert_close(ours[3], reference[3], atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2  # the layer and the head
    torch._dynamo.reset()


def test_fold_norms_is_off_by_default_on_the_cpu_and_refused_where_it_cannot_apply(tiny_qwen2: dict) -> None:
    model = _model(tiny_qwen2, lora=False)
    sampling = SamplingSettings(max_completion_length=4)
    assert not StaticDecoder(model, sampling, [2], 0, merge_weights=True).fold_norms  # no fused attention here
    for kwargs in ({"merge_weights": False}, {}):
        with pytest.raises(GRPOPluginsError, match="fold_norms cannot be used: .*merge_weights on"):
            StaticDecoder(model, sampling, [2], 0, fold_norms=True, **kwargs)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(GRPOPluginsError, match="fold_norms cannot be used: the MLP's activation is not SiLU"):
        StaticDecoder(model, sampling, [2], 0, merge_weights=True, fold_norms=True)


def test_the_torch_forms_equal_the_norm_then_product() -> None:
    torch.manual_seed(0)
    B, H, I, Hq, Hkv, D = 3, 24, 10, 4, 2, 8
    x, g1, g2 = torch.randn(B, H), torch.rand(H) + 0.5, torch.rand(H) + 0.5
    w_qkv, b_qkv, w_gu = torch.randn((Hq + 2 * Hkv) * D, H), torch.randn((Hq + 2 * Hkv) * D), torch.randn(2 * I, H)
    normed1 = x * inverse_rms(x, 1e-6) * g1
    q, k, v = (x @ (w_qkv * g1).T).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    got = torch.cat([t.reshape(B, -1) for t in normed_qkv(q.view(B, Hq, D), k.view(B, Hkv, D), v.view(B, Hkv, D), x, b_qkv, 1e-6)], -1)
    torch.testing.assert_close(got, normed1 @ w_qkv.T + b_qkv)
    gate, up = (x * inverse_rms(x, 1e-6) * g2 @ w_gu.T).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(rms_silu_mul_torch(x, x @ (w_gu * g2).T, 1e-6), want)
    torch.testing.assert_close(rms_silu_mul(x, x @ (w_gu * g2).T, 1e-6), want)  # the op: its torch form off a GPU


NORM_KERNELS = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators.decode_norms import check_norm_kernels
# float32 (the interpreter has no bfloat16): both Triton kernels against their torch forms.
for D, G in [(16, 4), (64, 7), (128, 1)]:
    fault = check_norm_kernels(torch.device("cpu"), D, G, torch.float32)
    assert fault is None, fault
print("ok")
"""


def test_the_triton_kernels_equal_their_torch_forms() -> None:
    _interpret(NORM_KERNELS)
