"""The decode step's attention: the batched-product form equals textbook grouped-query attention,
the Triton kernel (run by Triton's interpreter on the CPU, float32) equals the products, and a
whole static decode with the kernel samples what the products sample."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.decode_attention import fused_attention_unsupported, window_attention
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec
from triton_compile import compile_for_hopper, run_interpreted



def test_window_attention_is_grouped_query_attention_under_an_additive_mask() -> None:
    torch.manual_seed(0)
    B, Hkv, G, D, W = 2, 3, 4, 8, 10
    q, k, v = torch.randn(B, Hkv, G, D), torch.randn(B, Hkv, W, D), torch.randn(B, Hkv, W, D)
    bias = torch.zeros(B, W)
    bias[0, :3] = float("-inf")
    got = window_attention(q, k, v, bias, 0.3)
    for b in range(B):
        for h in range(Hkv * G):
            keep = bias[b] == 0
            kv = h // G  # query head h reads key/value head h // G
            scores = (q[b, kv, h % G].double() @ k[b, kv, keep].double().T) * 0.3
            expected = scores.softmax(-1) @ v[b, kv, keep].double()
            torch.testing.assert_close(got[b, kv, h % G].double(), expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_says_where_it_cannot_run() -> None:
    bf16 = torch.bfloat16
    assert "CUDA" in fused_attention_unsupported(torch.device("cpu"), 128, 7, bf16)
    cuda = torch.device("cuda")
    pytest.importorskip("triton", reason="Triton is part of the dev extra on Linux")
    assert fused_attention_unsupported(cuda, 128, 7, bf16) is None
    assert fused_attention_unsupported(cuda, 64, 4, torch.float16) is None
    assert "float32" in fused_attention_unsupported(cuda, 128, 7, torch.float32)
    assert "80" in fused_attention_unsupported(cuda, 80, 2, bf16)
    assert "8" in fused_attention_unsupported(cuda, 8, 2, bf16)
    assert "65" in fused_attention_unsupported(cuda, 64, 65, bf16)


def test_asking_for_the_kernel_where_it_cannot_run_names_the_setting(tmp_path: Path) -> None:
    model, _ = load_model(tiny_model_spec(tmp_path, "qwen2"), dtype="float32", seed=0)
    sampling = SamplingSettings(max_completion_length=4)
    with pytest.raises(GRPOPluginsError, match="fused_attention cannot run here: it needs a CUDA device; set fused_attention: false"):
        StaticDecoder(model, sampling, [2], 0, fused_attention=True)
    assert StaticDecoder(model, sampling, [2], 0).parts.fused_attention is False  # auto: off here


def _interpret(script: str, *args: str) -> None:
    run_interpreted(script, *args)


KERNEL_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators.decode_attention import check_kernel, run_rope_kernel, rope_window_attention
torch.manual_seed(0)
# float32 (the interpreter has no bfloat16). The new token's slot: in the first block, in the
# middle of one, the last of a window; q/k/v as views of one fused projection row.
for B, Hkv, G, D, S, W, cur in [(3, 2, 6, 64, 200, 130, 127), (2, 4, 7, 128, 80, 64, 63), (1, 1, 16, 32, 40, 17, 5), (2, 1, 1, 16, 90, 80, 70)]:
    fused = torch.randn(B, (G + 2) * Hkv * D)
    q, k, v = fused.split([G * Hkv * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, G * Hkv, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    angles = torch.rand(B, D // 2) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    caches = [torch.randn(B, Hkv, S, D) for _ in range(2)]
    bias = torch.zeros(B, W)
    bias[:, cur + 1 :] = float("-inf")  # slots not written yet
    bias[0, : min(70, cur) % W] = float("-inf")  # a left-padded row: its first block can be all masked
    index = torch.tensor([cur])
    want_k, want_v = (c.clone() for c in caches)
    want = rope_window_attention(q, k, v, cos, sin, want_k, want_v, index, bias, 0.125)
    # The whole window in one program, and split over programs (the parts after the new token,
    # and a padded row's first part, wholly masked) with their sums combined; other block sizes.
    # The cache's slots loaded before the index (early), the new token's discarded.
    for splits, block, early in ((None, 64, False), (2, 64, False), (3, 64, False), (1, 128, False), (2, 32, False), (None, 64, True), (3, 64, True)):
        got_k, got_v = (c.clone() for c in caches)
        got = run_rope_kernel(q, k, v, cos, sin, got_k, got_v, index, bias, 0.125, splits=splits, block=block, early=early)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
        assert torch.equal(got_v, want_v) and not torch.equal(got_k, caches[0])
from grpo_plugins.generators.decode_attention import window_splits
# Split only long windows, and only until the programs fill the GPU: as measured on an H100 (132
# multiprocessors), 64 rows x 2 heads of dim 128 unsplit, of dim 64 in two parts.
assert [window_splits(w, 64 * 2 * 128, 132) for w in (64, 256, 1088, 8192)] == [1, 1, 1, 1]
assert [window_splits(w, 64 * 2 * 64, 132) for w in (64, 256, 257, 1088, 8192)] == [1, 1, 2, 2, 2]
assert [window_splits(w, 16 * 4 * 128, 132) for w in (512, 4096)] == [2, 2]
# One row: as many parts as the window has pairs of blocks, at most MAX_SPLITS.
assert [window_splits(w, 2 * 64, 132) for w in (257, 576, 1088, 100000)] == [2, 4, 8, 16]
for D, G in [(16, 4), (128, 7)]:
    assert check_kernel(torch.device("cpu"), D, G, torch.float32) is None
    assert check_kernel(torch.device("cpu"), D, G, torch.float32, splits=3) is None
# A long window is split by default; where the split form failed its check, it is not.
import grpo_plugins.generators.decode_attention as da
B, Hkv, G, D, W = 1, 1, 2, 16, 600
assert da._split_fault(torch.device("cpu"), D, G, torch.float32) is None  # the check at first use, done before the spy
launched = []
combine = da._combine_kernel
class Spy:
    def __getitem__(self, grid):
        launched.append(grid)
        return combine[grid]
da._combine_kernel = Spy()
q, k, v = torch.randn(B, Hkv * G, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
cos, sin = torch.ones(B, D), torch.zeros(B, D)
cache = [torch.randn(B, Hkv, W, D) for _ in range(2)]
bias, index = torch.zeros(B, W), torch.tensor([W - 1])
want = rope_window_attention(q, k, v, cos, sin, *(c.clone() for c in cache), index, bias, 0.25)
assert da.window_splits(W, B * Hkv * D, da.multiprocessors(q.device)) == 5
torch.testing.assert_close(run_rope_kernel(q, k, v, cos, sin, *(c.clone() for c in cache), index, bias, 0.25), want, rtol=1e-4, atol=1e-4)
assert len(launched) == 1, launched  # split, and combined
da._split_fault = lambda *args: "a failed check"
torch.testing.assert_close(run_rope_kernel(q, k, v, cos, sin, *(c.clone() for c in cache), index, bias, 0.25), want, rtol=1e-4, atol=1e-4)
assert len(launched) == 1, launched  # one program per window: nothing to combine
print("ok")
"""


def test_the_triton_kernel_equals_the_torch_operations() -> None:
    _interpret(KERNEL_CHECK)


def test_the_torch_form_rotates_writes_and_attends_as_the_unfused_layer_does() -> None:
    from grpo_plugins.generators.decode_attention import rope_window_attention

    def turn(x: torch.Tensor) -> torch.Tensor:  # RoPE's rotate-half, written out
        return torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)

    torch.manual_seed(1)
    B, Hkv, G, D, S, W, cur = 2, 2, 3, 8, 12, 10, 6
    q, k, v = torch.randn(B, Hkv * G, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    cos, sin = torch.randn(B, D), torch.randn(B, D)
    k_cache, v_cache = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    bias = torch.zeros(B, W)
    bias[:, cur + 1 :] = float("-inf")
    kc, vc = k_cache.clone(), v_cache.clone()
    got = rope_window_attention(q, k, v, cos, sin, kc, vc, torch.tensor([cur]), bias, 0.5)
    k_rot = k * cos[:, None] + turn(k) * sin[:, None]
    q_rot = q * cos[:, None] + turn(q) * sin[:, None]
    k_cache[:, :, cur], v_cache[:, :, cur] = k_rot, v
    torch.testing.assert_close(kc, k_cache)
    torch.testing.assert_close(vc, v_cache)
    want = window_attention(q_rot.view(B, Hkv, G, D), k_cache[:, :, :W], v_cache[:, :, :W], bias, 0.5)
    torch.testing.assert_close(got, want)


DECODE_CHECK = """
import dataclasses, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec

# head_dim 16 (the kernel's smallest), 4 query heads per key/value head
spec = tiny_model_spec(Path(sys.argv[2]), "qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=1)
model, _ = load_model(spec, dtype="float32", seed=0)
prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 5, 6, 7, 8], [1, 40]]
sampling = SamplingSettings(max_completion_length=20, temperature=0.8)
import grpo_plugins.generators.decode_attention as da
results = []
for fused, block in ((False, None), (True, None), (True, 16)):
    if block:  # 16-slot blocks, one per program: these short windows are split over 2 programs
        da.BLOCK_W, da.BLOCKS_PER_SPLIT, da.MIN_BLOCKS_PER_SPLIT = block, 1, 1
    dec = StaticDecoder(model.eval(), sampling, [2], 0, prompt_multiple=8, window_step=8)
    dec.parts = dataclasses.replace(dec.parts, fused_attention=fused)  # auto turns it off on a CPU
    torch.manual_seed(3)
    results.append(dec.generate(prompts))
assert da.window_splits(27, 4 * 1 * 16, 132) == 2 and da._split_fault(torch.device("cpu"), 16, 4, torch.float32) is None  # so it did split
(ids0, mask0, trunc0, logps0) = results[0]
for ids1, mask1, trunc1, logps1 in results[1:]:
    assert torch.equal(ids0, ids1) and torch.equal(mask0, mask1) and torch.equal(trunc0, trunc1)
    torch.testing.assert_close(logps1, logps0, rtol=0, atol=5e-6)  # a 1% error in the kernel scores moves them 7e-5
assert int(mask0.sum()) > 8  # the comparison covers several windows of the cache
print("ok")
"""


def test_a_static_decode_with_the_kernel_samples_what_the_products_sample(tmp_path: Path) -> None:
    _interpret(DECODE_CHECK, str(tmp_path))


def test_a_kernel_that_disagrees_on_this_device_is_turned_off_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from grpo_plugins.generators import decode_attention

    model, _ = load_model(tiny_model_spec(tmp_path, "qwen2"), dtype="float32", seed=0)
    parts = StaticDecoder(model, SamplingSettings(max_completion_length=4), [2], 0).parts
    checked: list[tuple] = []

    def broken(*key: object) -> str:
        checked.append(key)
        return "its attention differs from the torch operations' by 0.5"

    monkeypatch.setattr(decode_attention, "fused_attention_unsupported", lambda *a: None)  # as on a GPU
    monkeypatch.setattr(decode_attention, "check_kernel", broken)
    decode_attention._kernel_fault.cache_clear()
    try:
        assert decode_attention.use_fused_attention(parts, False) is False and not checked
        with caplog.at_level("WARNING"):
            assert decode_attention.use_fused_attention(parts, None) is False
        assert "fused decode attention is off" in caplog.text and "differs" in caplog.text
        with pytest.raises(GRPOPluginsError, match="fused_attention cannot run here: its attention differs.*set fused_attention: false"):
            decode_attention.use_fused_attention(parts, True)
        assert len(checked) == 1  # once per device and head shape
    finally:
        decode_attention._kernel_fault.cache_clear()


def test_the_attention_kernels_compile_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compilation, not a cached one
    from grpo_plugins.generators import decode_attention as da

    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr", "o_ptr")}
    # The window in one program; a part of it, sums left for the combine; launched early (PDL).
    for partial, pdl, early in ((False, False, False), (True, False, False), (False, True, True)):
        signature = {
            **pointers, "index_ptr": "*i64", "bias_ptr": "*fp32", "scale": "fp32",
            "part_ptr": "*fp32" if partial else "*bf16", "stat_ptr": "*fp32" if partial else "*bf16",
            **{name: "i32" for name in da._rope_window_attention_kernel.arg_names if name.startswith("stride") or name in ("W", "per_split", "splits")},
        }
        asm = compile_for_hopper(da._rope_window_attention_kernel, signature, {"HKV": 2, "G": 6, "GP": 16, "D": 128, "BLOCK": 64, "PARTIAL": partial, "PDL": pdl, "EARLY": early})
        assert "cubin" in asm and "ld.global" in str(asm["ptx"]) and ("griddepcontrol.wait" in str(asm["ptx"])) == pdl
    for pdl in (False, True):
        asm = compile_for_hopper(da._combine_kernel, {"o_ptr": "*bf16", "part_ptr": "*fp32", "stat_ptr": "*fp32", "splits": "i32"}, {"G": 6, "GP": 16, "D": 128, "PDL": pdl})
        assert "cubin" in asm
