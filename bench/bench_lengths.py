"""The training pass on completions of varied length: padded against ``group_by_length``.

    python bench/bench_lengths.py --shape qwen2.5-7b --lora 16 --rows 64 --tokens 1024

One micro-step's forward+backward (the engine's own ``PolicyUpdate.micro_step``, with its
compiled layers and gradient checkpointing as configured) over a fixed batch, three ways:

* ``full``: every completion ``--tokens`` long (the all-max batch);
* ``varied-padded``: completion lengths drawn once from a long-tailed distribution (lognormal,
  median ``--median``, capped at ``--tokens``; the same lengths for every variant),
  ``group_by_length: false`` (one pass, padded to the longest row);
* ``varied-grouped``: the same batch with ``group_by_length: true``.

Each variant runs ``--warmup`` passes (compilation) and then ``--repeats`` timed ones
(CUDA-synchronised); the losses of the two varied variants are compared. Writes
``$OUT/bench_lengths.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
from bench._common import gib, length_reward, load_tokenizer, median, out_dir, reset_peak, sync, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(common.SHAPES))
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024, help="the longest completion")
    parser.add_argument("--prompt", type=int, default=60, help="prompt tokens per row")
    parser.add_argument("--median", type=int, default=300, help="median completion length of the varied batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["full", "varied-padded", "varied-grouped"])
    return parser.parse_args(argv)


def lengths(rows: int, cap: int, median_length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    import math

    return [min(cap, max(1, int(rng.lognormvariate(math.log(median_length), 0.6)))) for _ in range(rows)]


def rollout_for(completion_lengths: list[int], prompt: int, tokens: int, vocab: int, device: Any) -> Any:
    """A Rollout of left-padded prompts and right-padded completions of the given lengths."""
    from grpo_plugins.rollout_batches import Rollout

    rows = len(completion_lengths)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab - 10, (rows, prompt + tokens), generator=gen)
    att = torch.zeros(rows, prompt + tokens, dtype=torch.long)
    att[:, :prompt] = 1
    for row, n in enumerate(completion_lengths):
        att[row, prompt : prompt + n] = 1
    ids = ids * att
    loss_mask = att[:, prompt:].float()
    advantages = torch.randn(rows, generator=gen)
    return Rollout(
        prompt_index=list(range(rows)), input_ids=ids.to(device), attention_mask=att.to(device),
        loss_mask=loss_mask.to(device), advantages=advantages.to(device), old_logps=None, ref_logps=None,
        sampling_logps=None, window_items=[float(loss_mask.sum())], metrics={}, num_tokens=int(att.sum()),
        generate_seconds=0.0, reward_seconds=0.0,
    )


def run_variant(args: argparse.Namespace, name: str, completion_lengths: list[int]) -> dict[str, Any]:
    from bench.bench_grpo import _reset_accelerate, dataset, ours_config
    from grpo_plugins.batching import Step
    from grpo_plugins.engine import Engine
    from grpo_plugins.update import AccumulationWindow

    _reset_accelerate()
    common.LORA_R = args.lora
    config = ours_config(args.tokens, 1, 0, {"name": "transformers", "params": {}})
    config.update(
        per_device_train_batch_size=args.rows,
        group_by_length=name.endswith("grouped"),
        lora={"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"} if args.lora else None,
    )
    model = common.build_model(seed=0)
    engine = Engine(config, model=model, tokenizer=load_tokenizer(), rewards=[length_reward], dataset=dataset())
    engine._setup()
    rollout = rollout_for(completion_lengths, args.prompt, args.tokens, model.config.vocab_size, engine.accelerator.device)
    step = Step(step=0, batch=list(range(args.rows)), optimizer_update=True, rows=slice(0, args.rows))
    times, losses = [], []
    base = reset_peak()
    for i in range(args.warmup + args.repeats):
        window = AccumulationWindow()
        sync()
        t0 = time.perf_counter()
        engine.update.micro_step(rollout, step, rollout.window_items[0], window)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(torch.stack(window.losses).sum()))
        engine.optimizer.zero_grad(set_to_none=True)
        print(f"{name} pass {i}: {times[-1]:.3f} s", flush=True)
    record = {
        "seconds": median(times[args.warmup:]), "times": times, "loss": losses[-1],
        "peak_gib": gib(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0), "start_gib": gib(base),
        "tokens": int(rollout.attention_mask.sum()),
    }
    engine._teardown()
    del engine, model
    reset_peak()
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.ACTIVE_SHAPE = args.shape
    varied = lengths(args.rows, args.tokens, args.median)
    results: dict[str, Any] = {
        "args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "lengths": varied, "variants": {},
    }
    for name in args.variants:
        completion_lengths = [args.tokens] * args.rows if name == "full" else varied
        results["variants"][name] = run_variant(args, name, completion_lengths)
        write_json(out_dir() / "bench_lengths.json", results)
    full = results["variants"].get("full", {}).get("seconds")
    print(f"\n{'variant':<16} {'tokens':>8} {'s/pass':>8} {'of full':>8} {'peak GiB':>9} {'loss':>12}")
    for name, r in results["variants"].items():
        share = f"{r['seconds'] / full:.2f}" if full else "-"
        print(f"{name:<16} {r['tokens']:>8} {r['seconds']:>8.3f} {share:>8} {r['peak_gib']:>9.2f} {r['loss']:>12.6f}")
    real = sum(varied) + args.rows * args.prompt
    print(f"real tokens of the varied batch: {real} ({real / (args.rows * (args.prompt + args.tokens)):.2f} of the all-max batch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
