"""The log-prob chunk as two one-read Triton kernels (``grpo_plugins.fused_logprobs``): log-probs,
entropy and the gradients through the LM head equal ``chunk_logps``'s (Triton's interpreter),
inside the chunked, checkpointed pass too; where the kernels do not apply the compiled chunk
runs; the compiled layers use them on CUDA only; both kernels compile for an sm_90 GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.compiled_layers import CompiledLayers, compiled_layers_for
from grpo_plugins.fused_logprobs import FusedChunkLogps
from grpo_plugins.logprobs import _logit_transform, chunk_logps
from grpo_plugins.testing import tiny_model_config
from triton_compile import compile_for_hopper, run_interpreted

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins import fused_logprobs
from grpo_plugins.logprobs import _logit_transform, chunk_logps, chunked_selective_logps

fused_logprobs.BLOCK = 256  # several blocks per row, the last one partly masked
fused_logprobs.fused_logprobs_available = lambda device: True  # the interpreter runs on the CPU
calls = []
def fallback(*args):
    calls.append(args)
    return chunk_logps(*args)
fused = fused_logprobs.FusedChunkLogps(fallback)

class Config:
    logits_scaling = None
class LM:
    config = Config()

torch.manual_seed(0)
dtype = getattr(torch, sys.argv[2])
N, H, V = 12, 32, 1000
for temperature in (1.0, 0.7):
    transform = _logit_transform(LM(), temperature)
    for with_entropy in (False, True):
        head = torch.nn.Linear(H, V, bias=False).to(dtype)
        hidden = torch.randn(N, H, dtype=dtype) * 3
        targets = torch.randint(0, V, (N,))
        got, want = [], []
        for fn, out in ((fused, got), (chunk_logps, want)):
            h = hidden.clone().requires_grad_(True)
            head.zero_grad()
            logp, ent = fn(h, targets, head, transform, with_entropy)
            (logp * torch.linspace(-1, 2, N)).sum().backward()
            out.extend([logp.detach(), ent.detach(), h.grad, head.weight.grad.clone()])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for name, a, b in zip(("logp", "entropy", "hidden grad", "head grad"), got, want):
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name} T={temperature} entropy={with_entropy}: {m}")
        if with_entropy:
            assert got[1].abs().sum() > 0
# Granite's logits_scaling is a division too: the kernels take it with the temperature.
LM.config.logits_scaling = 4.0
transform = _logit_transform(LM(), 0.7)
head = torch.nn.Linear(H, V, bias=False).to(dtype)
hidden = torch.randn(N, H, dtype=dtype) * 20
targets = torch.randint(0, V, (N,))
torch.testing.assert_close(fused(hidden, targets, head, transform, True)[0], chunk_logps(hidden, targets, head, transform, True)[0], rtol=2e-2, atol=2e-2)
# inside the chunked pass, each chunk checkpointed (recomputed in backward)
hidden = torch.randn(2, 7, H, dtype=dtype)
targets = torch.randint(0, V, (2, 7))
results = []
for chunk_fn in (fused, None):
    h = hidden.clone().requires_grad_(True)
    logp, ent = chunked_selective_logps(h, targets, head, transform, chunk_size=4, with_entropy=True, chunk_fn=chunk_fn)
    logp.sum().backward()
    results.append((logp.detach(), ent, h.grad))
for a, b in zip(*results):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
assert not calls, "the fallback ran where the kernels apply"
print("ok")
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_entropy_and_gradients_equal_the_torch_chunk(dtype: str) -> None:
    run_interpreted(SCRIPT, dtype)


class _Config:
    logits_scaling: float | None = None
    final_logit_softcapping: float | None = None


class _LM:
    def __init__(self, **config: Any) -> None:
        self.config = _Config()
        for key, value in config.items():
            setattr(self.config, key, value)


@pytest.mark.parametrize(
    ("config", "temperature", "divisor"),
    [({}, 1.0, 1.0), ({}, 0.7, 0.7), ({"logits_scaling": 4.0}, 0.5, 2.0), ({"final_logit_softcapping": 30.0}, 1.0, None)],
)
def test_the_transform_says_when_it_only_divides(config: dict[str, Any], temperature: float, divisor: float | None) -> None:
    transform = _logit_transform(_LM(**config), temperature)
    assert transform.divisor == divisor  # type: ignore[attr-defined]
    if divisor is not None:  # and then dividing is what it does
        logits = torch.randn(3, 11)
        torch.testing.assert_close(transform(logits), logits / divisor)


def test_where_the_kernels_do_not_apply_the_fallback_runs() -> None:
    seen: list[tuple[Any, ...]] = []

    def fallback(*args: Any) -> Any:
        seen.append(args)
        return chunk_logps(*args)

    fused = FusedChunkLogps(fallback)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 20, (5,))
    plain = _logit_transform(_LM(), 0.7)
    capped = _logit_transform(_LM(final_logit_softcapping=3.0), 0.7)
    cases = [(plain, True), (capped, True), (plain, "grad")]  # a CPU tensor; soft-capping; the entropy bonus
    for transform, with_entropy in cases:
        got = fused(hidden, targets, head, transform, with_entropy)
        torch.testing.assert_close(got[0], chunk_logps(hidden, targets, head, transform, with_entropy)[0])
    assert len(seen) == len(cases)


def test_compiled_layers_use_the_kernels_only_when_asked() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_model_config("llama")))
    on_cpu = compiled_layers_for(model, None, torch.device("cpu")) or compiled_layers_for(model, True, torch.device("cpu"))
    assert on_cpu is not None and not isinstance(on_cpu.chunk_logps, FusedChunkLogps)
    asked = CompiledLayers.for_model(model, backend="aot_eager", fused_logprobs=True)
    assert asked is not None and isinstance(asked.chunk_logps, FusedChunkLogps)


def test_both_kernels_compile_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton", reason="Triton is part of the dev extra on Linux")
    from grpo_plugins import fused_logprobs as fl

    types = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "targets_ptr": "*i64", "divisor": "fp32"}
    for kernel, constants in ((fl._forward_kernel, {"BLOCK": 4096, "ENTROPY": True}), (fl._backward_kernel, {"BLOCK": 4096})):
        signature = {name: types.get(name, "*fp32" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
        ptx = str(compile_for_hopper(kernel, signature, constants)["ptx"])
        assert "ld.global" in ptx and "st.global" in ptx
