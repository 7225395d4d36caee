"""How far a float8 sampler is from the policy it samples for, on a real model.

Samples completions with the ``static`` generator (eager, no CUDA graph: runs on a CPU too) in
several settings and compares each sampled token's log-prob under the sampler with the policy's
teacher-forced log-prob (a plain forward pass), as the rollout correction sees them:

- ``bf16``: 16-bit policy, 16-bit merged decode copies (what the default decodes from);
- ``fp8``: 16-bit policy, float8 decode copies (``generator: {params: {fp8: true}}``);
- ``w8a16``: 16-bit policy, float8 decode weights multiplied with unquantised activations
  (emulated: the weight quantisation's share of the ``fp8`` difference);
- ``fp8base``: policy on a float8 base (``load_in_fp8``), float8 decode copies;
- ``fp8base-bf16``: policy on a float8 base, 16-bit decode copies of its dequantised weights
  (the activation quantisation's share).

    python bench/fp8_mismatch.py [--config examples/arithmetic_smollm2_lora_gpu.yaml] [--delta 0.003]

``--delta``: also measure with LoRA B matrices drawn at this standard deviation (a trained
adapter's stand-in). Prints the mean and largest |difference| in nats per token; JSON to
``$OUT/fp8_mismatch.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from grpo_plugins.config import load_config
from grpo_plugins.fp8_base import float8_base
from grpo_plugins.generators import static_layers
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model_and_tokenizer

VARIANTS = ("bf16", "fp8", "w8a16", "fp8base", "fp8base-bf16")


@contextlib.contextmanager
def weight_only_float8() -> Iterator[None]:
    """Float8 decode copies multiply with 16-bit activations: the weight is dequantised per call."""
    original = static_layers.FusedLinear.forward

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return original(self, x)
        return F.linear(x, (self.weight.float() * self.scale.t()).to(x.dtype), self.bias)

    static_layers.FusedLinear.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        static_layers.FusedLinear.forward = original  # type: ignore[method-assign]


def arithmetic_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Put the answer in <answer></answer>."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def policy_logps(model: Any, prompts: list[list[int]], completions: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    device = model.get_input_embeddings().weight.device
    out = []
    for prompt, completion, row_mask in zip(prompts, completions, mask):
        n = int(row_mask.sum())
        ids = torch.tensor([list(prompt) + completion[:n].tolist()], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : len(prompt) + n - 1]
        out.append(torch.log_softmax(logits, -1).gather(-1, completion[:n, None].to(device))[:, 0].cpu())
    return out


def mismatch(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int, fp8: bool, seed: int) -> dict[str, float]:
    decoder = StaticDecoder(
        model, SamplingSettings(max_completion_length=tokens, temperature=1.0), [tokenizer.eos_token_id],
        tokenizer.pad_token_id, compile=False, cuda_graph=False, fp8=fp8, merge_weights=True,
    )
    torch.manual_seed(seed)
    completions, mask, _, sampled = decoder.generate(prompts)
    completions, mask, sampled = completions.cpu(), mask.cpu(), sampled.cpu()
    policy = policy_logps(model, prompts, completions, mask)
    diff = torch.cat([(p - sampled[i, : len(p)].float()).abs() for i, p in enumerate(policy)])
    return {"tokens": diff.numel(), "mean": float(diff.mean()), "max": float(diff.max())}


def set_lora_b(model: Any, std: float) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/arithmetic_smollm2_lora_gpu.yaml")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--delta", type=float, default=0.0, help="also with LoRA B ~ N(0, delta) (0: skip)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    config = load_config(args.config)
    model, tokenizer = load_model_and_tokenizer(config)
    model.eval()
    prompts = arithmetic_prompts(tokenizer, args.prompts, args.seed)
    results: dict[str, Any] = {"config": args.config, "device": str(model.get_input_embeddings().weight.device), "runs": {}}
    deltas = [0.0] + ([args.delta] if args.delta else [])
    # The float8 base replaces the model's layers, so its variants come last.
    for variant in sorted(args.variants, key=lambda v: v.startswith("fp8base")):
        if variant.startswith("fp8base"):
            float8_base(model)
        for delta in deltas:
            set_lora_b(model, delta)
            started = time.perf_counter()
            patch = weight_only_float8() if variant == "w8a16" else contextlib.nullcontext()
            with patch:
                row = mismatch(model, tokenizer, prompts, args.tokens, variant in ("fp8", "w8a16", "fp8base"), args.seed)
            row["seconds"] = time.perf_counter() - started
            results["runs"][f"{variant} delta={delta:g}"] = row
            print(f"{variant:14s} LoRA B std {delta:<7g} tokens {row['tokens']:5d}  mean |diff| {row['mean']:.4f}  max {row['max']:.3f} nats", flush=True)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fp8_mismatch.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print("saved", path)


if __name__ == "__main__":
    main()
