"""Unsloth's GRPO (``UnslothGRPOTrainer``, FastLanguageModel + LoRA) on the benchmark's workload,
for a memory comparison with ``bench/profile_memory.py`` on the same GPU.

Run it with a Python whose environment holds Unsloth and no vLLM (measured with Unsloth
2026.10.9, TRL 1.15.0 and datasets 4.8.5; bench/README.md), ``fast_inference=False``, the random
model saved to an absolute path. Unsloth turns on ``mask_truncated_completions`` and
``epsilon_high: 0.28`` by itself in a DAPO config; compare it with ``profile_memory.py``'s
``mask-truncated`` variant (or read the values it prints from the trainer's final arguments).

    HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1 \\
        python bench/bench_unsloth.py --lora 16 --tokens 256 --rows 64 --steps 3 --warmup 1 \\
        --out $OUT/unsloth_0.4b.json

For long completions (7B shape, 16 x 8192) train one row per forward+backward, as this project's
``train_chunk_rows: 1`` does, and save the random model once for the LoRA and the QLoRA run::

    python bench/bench_unsloth.py --shape qwen2.5-7b --model-dir $PWD/outputs/bench/models/qwen2.5-7b --save-only
    python bench/bench_unsloth.py --shape qwen2.5-7b --model-dir $PWD/outputs/bench/models/qwen2.5-7b --tokens 8192 --rows 16 \\
        --micro-rows 1 --steps 1 --warmup 0 [--load-in-4bit] --out $OUT/unsloth_7b.json

Prints and writes: median step seconds after ``--warmup``, the peak of torch's allocator over
the training steps (``max_memory_allocated``, as profile_memory.py reports), the trainer class
(must be ``UnslothGRPOTrainer``: Unsloth falls back to TRL's silently when its patch fails), and
the settings Unsloth ended up with. While it runs, a thread appends torch's allocator counters
every 10 s to ``<out>.progress.jsonl``, so a run stopped before its end (Unsloth's 7B generation
at 16 x 8192 took more than 20 minutes) still shows its peak so far on the same measure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import unsloth  # noqa: F401  (must come before transformers, peft and trl: it patches them)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as _common  # noqa: E402


def watch_memory(path: Path, every: float = 10.0) -> None:
    """Start a daemon thread appending allocator counters (GiB) to ``path`` every ``every`` s."""
    import json
    import threading

    import torch

    start = time.perf_counter()

    def run() -> None:
        while True:
            time.sleep(every)
            row = {
                "pid": os.getpid(),  # to find this process in nvidia-smi's per-process log
                "elapsed_s": round(time.perf_counter() - start, 1),
                "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            }
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    if torch.cuda.is_available():
        threading.Thread(target=run, name="memory-watch", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smol-vocab-0.4b", help="model shape: " + ", ".join(_common.SHAPES))
    parser.add_argument("--lora", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-rows", type=int, default=0, help="rows per forward+backward (default: --rows, one micro-batch)")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument("--model-dir", default=None, help="an absolute folder for the random model: reused when it holds one")
    parser.add_argument("--save-only", action="store_true", help="build and save the model to --model-dir, then stop")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    _common.ACTIVE_SHAPE = args.shape

    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from unsloth import FastLanguageModel

    from bench._common import build_model, gib, length_reward, load_tokenizer, median, out_dir, prompt_texts, write_json

    # An absolute path, as Unsloth needs; a 7B model is built and saved once for several runs.
    folder = str(Path(args.model_dir).resolve()) if args.model_dir else tempfile.mkdtemp(prefix="bench_unsloth_model_")
    if not (Path(folder) / "config.json").exists():
        tokenizer = load_tokenizer()
        model = build_model(seed=0, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
    if args.save_only:
        print(f"saved the random model to {folder}", flush=True)
        return
    micro_rows = args.micro_rows or args.rows

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=folder, max_seq_length=1024 + args.tokens, dtype=torch.bfloat16,
        load_in_4bit=args.load_in_4bit, fast_inference=False, max_lora_rank=args.lora,
    )
    model = FastLanguageModel.get_peft_model(
        model, r=args.lora, lora_alpha=2 * args.lora, random_state=0, use_gradient_checkpointing="unsloth",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )

    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if len(ends) == args.warmup:
                torch.cuda.reset_peak_memory_stats()  # the peak of the measured steps only

    import datasets

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_unsloth_"), per_device_train_batch_size=micro_rows,
        gradient_accumulation_steps=args.rows // micro_rows, num_generations=8, max_completion_length=args.tokens, temperature=1.0,
        beta=0.0, loss_type="dapo", learning_rate=1e-6, bf16=True, max_steps=args.warmup + args.steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=0,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[length_reward], args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompt_texts(256)}), callbacks=[StepTimer()],
    )
    out_path = Path(args.out) if args.out else out_dir() / "unsloth.json"
    watch_memory(out_path.with_name(out_path.stem + ".progress.jsonl"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    used = trainer.args
    result = {
        "framework": "unsloth", "pid": os.getpid(), "unsloth": getattr(unsloth, "__version__", "?"), "trainer": type(trainer).__name__,
        "shape": args.shape, "lora": args.lora, "tokens": args.tokens, "rows": args.rows, "micro_rows": micro_rows,
        "load_in_4bit": args.load_in_4bit,
        "step_s": median(steps[args.warmup:]) if len(steps) > args.warmup else None, "step_times": steps,
        "peak_gib": gib(torch.cuda.max_memory_allocated()),
        "settings_used": {k: getattr(used, k, None) for k in (
            "mask_truncated_completions", "epsilon", "epsilon_high", "loss_type", "beta", "gradient_checkpointing")},
    }
    print(result, flush=True)
    write_json(out_path, result)
    if result["trainer"] != "UnslothGRPOTrainer":
        print("WARNING: Unsloth's patch did not apply; these are TRL's numbers", flush=True)


if __name__ == "__main__":
    main()
