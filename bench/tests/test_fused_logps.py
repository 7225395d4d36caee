"""bench/fused_logps.py, the log-prob chunk as two one-read Triton kernels: log-probs, entropy and
the gradients through the LM head equal ``chunk_logps``'s (Triton's interpreter), inside the
chunked, checkpointed pass as well; and both kernels compile for an sm_90 GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from triton_compile import compile_for_hopper, run_interpreted  # noqa: E402

SCRIPT = """
import functools, sys
sys.path.insert(0, sys.argv[1])
import torch
from bench import fused_logps
from grpo_plugins.logprobs import chunk_logps, chunked_selective_logps

fused_logps.BLOCK = 256  # several blocks per row, the last one partly masked
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[2])
N, H, V = 12, 32, 1000
for temperature in (1.0, 0.7):
    for with_entropy in (False, True):
        head = torch.nn.Linear(H, V, bias=False).to(dtype)
        hidden = torch.randn(N, H, dtype=dtype) * 3
        targets = torch.randint(0, V, (N,))
        transform = lambda x: x / temperature if temperature != 1.0 else x
        got, want = [], []
        for fn, out in ((functools.partial(fused_logps.fused_chunk_logps, temperature=temperature), got), (chunk_logps, want)):
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
# inside the chunked pass, each chunk checkpointed (recomputed in backward)
head = torch.nn.Linear(H, V, bias=False).to(dtype)
hidden = torch.randn(2, 7, H, dtype=dtype)
targets = torch.randint(0, V, (2, 7))
results = []
for chunk_fn in (functools.partial(fused_logps.fused_chunk_logps, temperature=1.0), None):
    h = hidden.clone().requires_grad_(True)
    logp, ent = chunked_selective_logps(h, targets, head, chunk_size=4, with_entropy=True, chunk_fn=chunk_fn)
    logp.sum().backward()
    results.append((logp.detach(), ent, h.grad))
for a, b in zip(*results):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
print("ok")
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_entropy_and_gradients_equal_the_torch_chunk(dtype: str) -> None:
    run_interpreted(SCRIPT, dtype)


def test_both_kernels_compile_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench import fused_logps as fl

    types = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "targets_ptr": "*i64", "temperature": "fp32"}
    for kernel, constants in ((fl._forward_kernel, {"BLOCK": 4096, "ENTROPY": True}), (fl._backward_kernel, {"BLOCK": 4096})):
        signature = {name: types.get(name, "*fp32" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
        ptx = str(compile_for_hopper(kernel, signature, constants)["ptx"])
        assert "ld.global" in ptx and "st.global" in ptx
