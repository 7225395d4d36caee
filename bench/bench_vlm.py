"""GRPO step time and memory on a vision-language model: this project's Engine vs TRL's
GRPOTrainer, same process, same model shape and initial weights, processor, image prompts, reward
and settings (bench/README.md).

    python bench/bench_vlm.py --tokens 256 --steps 4 --warmup 2
    python bench/bench_vlm.py --tiny --tokens 8 --steps 1 --warmup 1    # the wiring, on a CPU

The model: Qwen2.5-VL-3B's shape (:data:`QWEN25_VL_3B`), randomly initialised, with the bench
tokenizer (SmolLM2's, ``bash bench/gpu_suite.sh setup``) plus Qwen's vision tokens; images are
the built-in ``shapes`` task's pictures at ``--image-size`` pixels, which Qwen2-VL's image
processor cuts into 14-pixel patches (448 px: 1024 patches, 256 image tokens per prompt).
``--tiny`` shrinks the model and uses a character tokenizer (no setup needed).

Settings for both: bf16 weights (float32 on a CPU), LoRA r=16 on the language model's linear
layers (vision encoder frozen), 8 prompts x 8 generations = 64 completions per step, batch 64,
gradient_accumulation_steps 1, beta 0, loss dapo, temperature 1.0, learning rate 1e-6, gradient
checkpointing on. The random model almost never emits EOS, so both sample the full T tokens.

Seconds per step are wall-clock times between the ends of consecutive optimizer steps (CUDA
synchronised), median after the warm-up steps; generate / score / train are each framework's own
timers. Writes ``$OUT/vlm_bench.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    DEVICE,
    TINY,
    gib,
    length_reward,
    load_tokenizer,
    median,
    out_dir,
    peak,
    reset_peak,
    sync,
    write_json,
)
from bench.bench_grpo import _reset_accelerate, log  # noqa: E402

#: Qwen2.5-VL-3B-Instruct's shape (its config.json); the weights here are random.
QWEN25_VL_3B: dict[str, Any] = {
    "text_config": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "tie_word_embeddings": True,
}
#: What ``--tiny`` changes (the rest of the shape stays, so the same code paths run).
TINY_CHANGES: dict[str, dict[str, Any]] = {
    "text_config": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
    },
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "window_size": 56, "fullatt_block_indexes": [1],
    },
}
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
#: Qwen's chat format (ChatML) with its image placeholder, for string and content-list messages.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: LoRA on the language model's linear layers only (peft matches a string in full as a regex).
LANGUAGE_LORA_TARGETS = r".*language_model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
LORA_R = 16
RESULTS: dict[str, Any] = {"runs": {}, "errors": []}


def model_config(tiny: bool, processor: Any) -> Any:
    """The Qwen2.5-VL config of the benchmark model (``tiny``: :data:`TINY_CHANGES` applied)."""
    from transformers import Qwen2_5_VLConfig

    shape = {key: dict(value) if isinstance(value, dict) else value for key, value in QWEN25_VL_3B.items()}
    if tiny:
        for key, changes in TINY_CHANGES.items():
            shape[key].update(changes)
        shape["text_config"]["vocab_size"] = len(processor.tokenizer)
    tok = processor.tokenizer
    ids = {f"{name}_token_id": tok.convert_tokens_to_ids(token) for name, token in
           [("vision_start", "<|vision_start|>"), ("image", "<|image_pad|>"), ("vision_end", "<|vision_end|>"), ("video", "<|video_pad|>")]}
    text = {
        **shape.pop("text_config"),
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }
    return Qwen2_5_VLConfig(text_config=text, **shape, **ids)


def _processor_class() -> type:
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video processor (which needs torchvision)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyProcessor


def build_processor(tiny: bool, image_size: int) -> Any:
    """Qwen2-VL's image processor (every picture becomes ``image_size`` rounded to 28 pixels) with
    the bench tokenizer (``tiny``: the test character tokenizer) plus the vision tokens."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if tiny:
        from grpo_plugins.testing.tiny import build_tiny_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp)))
    else:
        tokenizer = load_tokenizer()
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.padding_side = "left"
    side = max(28, round(image_size / 28) * 28)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=side * side, max_pixels=side * side
    )
    return _processor_class()(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(config: Any, seed: int = 0) -> Any:
    """A fresh random model of ``config`` on the bench device (same weights for the same seed)."""
    from transformers import AutoModelForImageTextToText

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model


def dataset(image_size: int, n: int = 256) -> Any:
    """The ``shapes`` task's pictures and counting questions (TRL's conversational image format)."""
    from builtin_rewards.vision_tasks import ShapesTask

    return ShapesTask(ShapesTask.Params(num_samples=n, num_eval_samples=1, image_size=image_size)).load(0)


def ours_config(T: int, steps: int, warmup: int, generator: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """The Engine config of the benchmark workload (TRL's settings in :func:`run_trl`)."""
    return {
        "task": None,
        "dtype": "bfloat16" if DEVICE == "cuda" else "float32",
        "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 1,
        "num_generations": 8,
        "max_completion_length": T,
        "max_prompt_length": 2048,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": 1e-6,
        "gradient_checkpointing": True,
        "max_steps": warmup + steps,
        "logging_steps": 1,
        "save_steps": 100000,
        "report_to": [],
        "generator": generator,
        "output_dir": output_dir,
        "seed": 0,
        "lora": {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": LANGUAGE_LORA_TARGETS},
    }


def run_ours(args: argparse.Namespace, T: int, generator_name: str) -> dict[str, Any]:
    from grpo_plugins.engine import Engine

    processor = build_processor(args.tiny, args.image_size)
    model = build_model(model_config(args.tiny, processor))
    output_dir = tempfile.mkdtemp(prefix="bench_vlm_ours_")
    generator = {"name": generator_name, "params": {}}
    config = ours_config(T, args.steps, args.warmup, generator, output_dir)
    # The processor goes where a text model's tokenizer goes.
    engine = Engine(config, model=model, tokenizer=processor, rewards=[length_reward], dataset=dataset(args.image_size))
    ends: list[float] = []
    original = Engine._optimizer_step

    def timed_step(self: Any, *a: Any, **kw: Any) -> Any:
        record = original(self, *a, **kw)
        sync()
        ends.append(time.perf_counter())
        return record

    engine._optimizer_step = timed_step.__get__(engine)  # type: ignore[method-assign]
    base = reset_peak()
    sync()
    start = time.perf_counter()
    history = engine.train().history
    step_times = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    measured = slice(args.warmup, None)

    def pick(key: str) -> float:
        return median([h.get(key, float("nan")) for h in history][measured])

    out = {
        "step_s": median(step_times[measured]),
        "step_times": step_times,
        "generate_s": pick("timing/generate"),
        "score_s": pick("timing/reward"),
        "train_s": pick("timing/train"),
        "mean_length": pick("completions/mean_length"),
        "peak_gib": gib(peak()),
        "start_allocated_gib": gib(base),
        "losses": [h.get("loss") for h in history],
    }
    del engine, model
    shutil.rmtree(output_dir, ignore_errors=True)
    return out


def run_trl(args: argparse.Namespace, T: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same workload (generation with transformers)."""
    import trl.extras.profiling as profiling
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timings: list[tuple[str, float]] = []
    original_log = profiling.ProfilingContext._log_metrics

    def record(self: Any, duration: float) -> None:
        timings.append((self.name, duration))
        original_log(self, duration)

    ends: list[float] = []
    marks: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            ends.append(time.perf_counter())
            marks.append(len(timings))

    processor = build_processor(args.tiny, args.image_size)
    model = build_model(model_config(args.tiny, processor))
    peft_config = LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules=LANGUAGE_LORA_TARGETS, task_type="CAUSAL_LM")
    output_dir = tempfile.mkdtemp(prefix="bench_vlm_trl_")
    warmup = args.trl_warmup
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=T,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-6,
        gradient_checkpointing=True,
        bf16=DEVICE == "cuda",
        max_steps=warmup + (args.trl_steps or args.steps),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=DEVICE != "cuda",
    )
    profiling.ProfilingContext._log_metrics = record  # type: ignore[method-assign]
    try:
        trainer = GRPOTrainer(
            model=model, reward_funcs=[length_reward], args=config, train_dataset=dataset(args.image_size),
            processing_class=processor, callbacks=[StepTimer()], peft_config=peft_config,
        )
        base = reset_peak()
        sync()
        start = time.perf_counter()
        trainer.train()
    finally:
        profiling.ProfilingContext._log_metrics = original_log  # type: ignore[method-assign]
    step_times = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    per_step: list[dict[str, float]] = []
    for i, end_mark in enumerate(marks):
        totals: dict[str, float] = {}
        for name, seconds in timings[marks[i - 1] if i else 0 : end_mark]:
            totals[name] = totals.get(name, 0.0) + seconds
        per_step.append(totals)

    def pick(key: str) -> float:
        return median([s.get(key, 0.0) for s in per_step[warmup:]])

    step, prepare = median(step_times[warmup:]), pick("GRPOTrainer._prepare_inputs")
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    out = {
        "step_s": step,
        "step_times": step_times,
        "generate_s": pick("GRPOTrainer.transformers.generate") or pick("GRPOTrainer._generate"),
        "score_s": pick("GRPOTrainer._calculate_rewards"),
        "train_s": step - prepare,
        "prepare_inputs_s": prepare,
        "mean_length": median(lengths[warmup:]) if lengths else float("nan"),
        "peak_gib": gib(peak()),
        "start_allocated_gib": gib(base),
        "profiling_names": sorted({n for n, _ in timings}),
    }
    del trainer, model
    shutil.rmtree(output_dir, ignore_errors=True)
    return out


def table(tokens: list[int]) -> str:
    lines = [
        "",
        f"VLM GRPO step, 64 completions (8 prompts x 8), {RESULTS.get('model')}, {RESULTS.get('image_size')} px images, "
        f"LoRA r={LORA_R} on the language model -- device: {RESULTS.get('device')}",
        "",
        f"{'T':>5} {'framework':<12} {'step s':>7} {'generate':>9} {'score':>7} {'train':>7} {'tok/s':>8} {'peak GiB':>9} {'len':>6}",
    ]
    for T in tokens:
        runs = RESULTS["runs"].get(str(T), {})
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{T:>5} {name:<12} ERROR {r['error'][:70]}")
                continue
            lines.append(
                f"{T:>5} {name:<12} {r['step_s']:>7.2f} {r['generate_s']:>9.2f} {r['score_s']:>7.3f} {r['train_s']:>7.2f} "
                f"{64 / r['step_s'] * r['mean_length']:>8.0f} {r['peak_gib']:>9.2f} {r['mean_length']:>6.0f}"
            )
        t = runs.get("trl", {})
        for name, o in runs.items():
            if not name.startswith("ours") or not t or "error" in o or "error" in t:
                continue
            ratio = o["peak_gib"] / t["peak_gib"] if t["peak_gib"] else float("nan")
            label = "trl / " + name
            lines.append(
                f"{T:>5} {label:<12} {t['step_s'] / o['step_s']:>6.1f}x {t['generate_s'] / o['generate_s']:>8.1f}x "
                f"{'':>7} {t['train_s'] / o['train_s']:>6.1f}x {'':>8} {ratio:>8.2f}*"
            )
    lines.append("\n* peak memory ratio is ours / TRL (lower is better); time ratios are TRL / ours.")
    if RESULTS["errors"]:
        lines.append(f"{len(RESULTS['errors'])} error(s): see vlm_bench.json")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256], help="completion lengths T")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trl-steps", type=int, default=None, help="measured TRL steps (default --steps)")
    parser.add_argument("--trl-warmup", type=int, default=1)
    parser.add_argument("--frameworks", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument(
        "--generator", nargs="+", default=["transformers"],
        help="the Engine's generator(s): one ours run each (named 'ours <generator>' when several)",
    )
    parser.add_argument("--image-size", type=int, default=448, help="picture side in pixels (rounded to 28)")
    parser.add_argument(
        "--tiny", action="store_true", default=TINY, help="a tiny model and character tokenizer (CPU wiring check; also BENCH_TINY=1)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    RESULTS.update(
        runs={}, errors=[], model="tiny Qwen2.5-VL" if args.tiny else "Qwen2.5-VL-3B shape (random)",
        image_size=args.image_size, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__, args=vars(args),
    )
    runs: list[tuple[str, str | None]] = []
    for name in args.frameworks:
        if name == "ours":
            several = len(args.generator) > 1
            runs += [(f"ours {g}" if several else "ours", g) for g in args.generator]
        else:
            runs.append((name, None))
    for T in args.tokens:
        for name, generator in runs:
            log(f"== {name} T={T}")
            try:
                _reset_accelerate()
                r = run_ours(args, T, generator) if generator is not None else run_trl(args, T)
            except Exception as exc:
                r = {"error": repr(exc)}
                RESULTS["errors"].append({"run": f"{name} {T}", "error": repr(exc), "trace": traceback.format_exc()})
                log(traceback.format_exc())
            RESULTS["runs"].setdefault(str(T), {})[name] = r
            log(f"{name} T={T}: {r}")
            write_json(out_dir() / "vlm_bench.json", RESULTS)
            reset_peak()
    print(table(args.tokens), flush=True)
    return RESULTS


if __name__ == "__main__":
    main()
