"""How far a float8 base (``load_in_fp8``) turns the LoRA gradient, on a real model.

The same batch and loss (sequence log-probs weighted by fixed random advantages, as a policy
gradient is) through the LoRA model four ways; each gradient against the 16-bit one:

- ``float32``: the 16-bit base in float32 (how much of the gradient 16-bit arithmetic itself
  decides: the floor);
- ``fp8``: the float8 base as trained (float8 weights, inputs and output gradients);
- ``fp8-mlp16``: the float8 base with the MLP projections left 16-bit;
- ``fp8-first4``: the float8 base with the first four decoder layers left 16-bit.

Prints the cosine of the whole gradient and per block of layers, and the norm ratio. A policy
gradient that the float8 base turns far from the 16-bit one trains a different policy.

    python bench/fp8_gradients.py [--config examples/arithmetic_smollm2_lora_gpu.yaml] [--lora-b 0.003]

JSON to ``$OUT/fp8_gradients.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from grpo_plugins.config import load_config
from grpo_plugins.fp8_base import Float8Linear, float8_base
from grpo_plugins.models import load_model_and_tokenizer

VARIANTS = ("float32", "fp8", "fp8-mlp16", "fp8-first4")


def arithmetic_texts(n: int, seed: int) -> list[str]:
    """Worked sums as the GPU example's task writes them (prompt and answer in one text)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        texts.append(f"What is {a} + {b}? Think, then answer. {a} plus {b} is {a + b}. <answer>{a + b}</answer>")
    return texts


def lora_gradient(model: Any, batch: dict[str, torch.Tensor], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of ``-mean(advantage * mean token log-prob)`` for every trainable parameter."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logps = torch.log_softmax(logits, dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["attention_mask"][:, 1:].float()
    loss = -((logps * mask).sum(1) / mask.sum(1) * advantages).mean()
    loss.backward()
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}


def _layer(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def keep_16_bit(model: Any, reference: Any, keep: Any) -> None:
    """Put the 16-bit linear layers of ``reference`` back where ``keep(name)`` says so."""
    modules = dict(reference.named_modules())
    for name, module in list(model.named_modules()):
        if isinstance(module, Float8Linear) and keep(name):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, copy.deepcopy(modules[name]))


def compare(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], blocks: int = 10) -> dict[str, Any]:
    """Cosine of the whole gradient, per block of ``blocks`` layers, and the norm ratio."""
    a = torch.cat([v.flatten() for v in reference.values()])
    b = torch.cat([other[k].flatten() for k in reference])
    per_block: dict[str, list[float]] = {}
    for name, grad in reference.items():
        start = _layer(name) // blocks * blocks
        per_block.setdefault(f"layers {start}-{start + blocks - 1}", []).append(
            float(F.cosine_similarity(grad.flatten(), other[name].flatten(), dim=0))
        )
    return {
        "cosine": float(F.cosine_similarity(a, b, dim=0)),
        "norm_ratio": float(b.norm() / a.norm().clamp(min=1e-30)),
        "mean_cosine_per_parameter": {k: sum(v) / len(v) for k, v in sorted(per_block.items())},
    }


def measure(model: Any, tokenizer: Any, texts: list[str], variants: list[str], seed: int) -> dict[str, Any]:
    """Every variant's gradient against the 16-bit base's, on ``texts`` (see the module docstring)."""
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    advantages = torch.randn(len(texts), generator=torch.Generator().manual_seed(seed)).to(model.device)
    base = lora_gradient(model, batch, advantages)
    results: dict[str, Any] = {}
    for variant in variants:
        other = copy.deepcopy(model)
        if variant == "float32":
            other.float()
        else:
            float8_base(other)
            if variant == "fp8-mlp16":
                keep_16_bit(other, model, lambda name: ".mlp." in name)
            elif variant == "fp8-first4":
                keep_16_bit(other, model, lambda name: 0 <= _layer(name) < 4)
        results[variant] = compare(base, lora_gradient(other, batch, advantages))
        del other
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/arithmetic_smollm2_lora_gpu.yaml")
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--lora-b", type=float, default=0.003, help="LoRA B ~ N(0, this): a trained adapter's stand-in")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = load_config(args.config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model_and_tokenizer(config, device=device)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=args.lora_b)
    results = measure(model, tokenizer, arithmetic_texts(args.texts, args.seed), args.variants, args.seed)
    for variant, row in results.items():
        blocks = "  ".join(f"{k}: {v:.3f}" for k, v in row["mean_cosine_per_parameter"].items())
        print(f"{variant:<11} cosine {row['cosine']:+.3f}  norm ratio {row['norm_ratio']:.3f}  per parameter, mean: {blocks}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "fp8_gradients.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": args.config, "device": str(device), "lora_b": args.lora_b, "results": results}, indent=1))


if __name__ == "__main__":
    main()
