"""GPU check of the fused log-prob kernels (``grpo_plugins.fused_logprobs``) at a real vocabulary.

One chunk shaped like the training passes' (1024 positions, Qwen2.5-0.5B's hidden size 896 and
vocabulary 151,936, bf16 head), for temperatures 1.0 and 0.7, with and without the entropy:
log-probs, entropy and the gradients into the hidden states and the head from the fused
kernels against ``chunk_logps`` computed in float32 from the same bf16 logits. Prints the
largest differences and the time of each; exits 1 where a difference exceeds its tolerance.

    python bench/check_fused_logprobs.py --out $OUT/fused_logprobs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_plugins.fused_logprobs import FusedChunkLogps  # noqa: E402
from grpo_plugins.logprobs import chunk_logps  # noqa: E402

#: Largest allowed difference: log-probs and entropy (nats), gradients (relative to their largest entry).
TOLERANCE = {"logp": 2e-3, "entropy": 2e-3, "hidden_grad": 2e-2, "head_grad": 2e-2}


def run(N: int, H: int, V: int, temperature: float, with_entropy: bool) -> dict[str, float]:
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, V, (N,), device="cuda")
    weights = torch.randn(N, device="cuda")

    def transform(logits: torch.Tensor) -> torch.Tensor:
        return logits / temperature

    transform.divisor = temperature  # type: ignore[attr-defined]
    fused = FusedChunkLogps(chunk_logps)
    out = {}
    for name, fn in (("fused", fused), ("torch", chunk_logps)):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logp, ent = fn(h, targets, head, transform, with_entropy)
        (logp * weights).sum().backward()
        end.record()
        torch.cuda.synchronize()
        out[name] = (logp.detach(), ent.detach(), h.grad.float(), head.weight.grad.float(), start.elapsed_time(end))
    f, t = out["fused"], out["torch"]
    return {
        "logp": float((f[0] - t[0]).abs().max()),
        "entropy": float((f[1] - t[1]).abs().max()) if with_entropy else 0.0,
        "hidden_grad": float((f[2] - t[2]).abs().max() / t[2].abs().max()),
        "head_grad": float((f[3] - t[3]).abs().max() / t[3].abs().max()),
        "fused_ms": f[4],
        "torch_ms": t[4],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results, failed = [], []
    for temperature in (1.0, 0.7):
        for with_entropy in (False, True):
            row = {"temperature": temperature, "entropy": with_entropy,
                   **run(args.rows, args.hidden, args.vocab, temperature, with_entropy)}
            results.append(row)
            print(row)
            failed += [f"{k} T={temperature} entropy={with_entropy}: {row[k]:.3g}" for k, tol in TOLERANCE.items() if row[k] > tol]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print("FAILED: " + "; ".join(failed) if failed else "ok")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
