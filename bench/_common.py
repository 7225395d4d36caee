"""Shared pieces of the benchmarks: the model shape, tokenizer, prompts and reward (bench/README.md)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

#: Qwen2-0.5B's shape with SmolLM2's vocabulary (402M parameters), randomly initialised.
MODEL_SHAPE: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
}

#: Qwen2.5 shapes (their real vocabularies) for the scale benchmarks.
SHAPES: dict[str, dict[str, Any]] = {
    "smol-vocab-0.4b": MODEL_SHAPE,
    "qwen2.5-0.5b": {
        **MODEL_SHAPE, "vocab_size": 151936, "max_position_embeddings": 32768,
    },
    "qwen2.5-1.5b": {
        **MODEL_SHAPE, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 32768,
    },
    "qwen2.5-7b": {
        **MODEL_SHAPE, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
        "tie_word_embeddings": False, "max_position_embeddings": 32768,
    },
}
#: The shape build_model() uses (bench scripts set it from --shape).
ACTIVE_SHAPE = "smol-vocab-0.4b"

#: The SmolLM2 tokenizer saved from the embedded GGUF (``bash bench/gpu_suite.sh setup``, bench/README.md).
TOKENIZER_DIR = Path(os.environ.get("BENCH_TOKENIZER", ".benchdata/tokenizer"))


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: BENCH_TINY=1 shrinks the model for a dry run of the scripts on a CPU.
TINY = os.environ.get("BENCH_TINY") == "1"


def model_shape() -> dict[str, Any]:
    shape = dict(SHAPES[ACTIVE_SHAPE])
    if TINY:
        shape.update(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=49152,
        )
    return shape


def build_model(seed: int = 0, device: str = DEVICE, dtype: torch.dtype | None = None) -> Any:
    """A fresh random model of :data:`MODEL_SHAPE` (same weights for the same seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    shape = model_shape()
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = None
    return model


def prompt_texts(n: int = 256) -> list[str]:
    """Plain-text prompts of roughly 40-60 tokens."""
    return [
        f"Problem {i}: a train leaves the station at {i % 12 + 1} o'clock travelling at {30 + i % 50} km/h, "
        f"and a second train follows {i % 5 + 1} hours later at {60 + i % 40} km/h. After how many hours "
        "does the second train catch up with the first? Think step by step and give the answer."
        for i in range(n)
    ]


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """A cheap reward that varies between completions (so advantages are not all zero)."""
    return [len(set(str(c))) / 100.0 for c in completions]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[Any, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def reset_peak() -> int:
    """Free cached blocks, reset the peak counter; returns the bytes allocated now."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def out_dir() -> Path:
    return Path(os.environ.get("OUT", "outputs/bench"))


def graph_time_us(calls: list[Callable[[], Any]], repeats: int = 30) -> float:
    """Mean time in microseconds of one of ``calls`` (each on its own copy of the data, so that it
    comes from memory rather than L2), all captured in one CUDA graph and replayed ``repeats``
    times, as a decode step runs them."""
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats / len(calls)
