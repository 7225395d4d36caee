"""Where the ``vllm`` generator's time goes: one engine, one shape, several ways of asking.

The ``vllm`` generator was 2.7x slower than ``static`` at 0.5B x 256 (1.36 vs 0.51 s per
generation, bench/RESULTS.md). This script starts the engine the way the generator does (our
``VLLMGenerator.setup`` on the benchmark's random Qwen2.5-0.5B shape) and times
``LLM.generate`` for 8 prompts x 8 samples x ``--tokens`` tokens (``ignore_eos``) with one setting
changed at a time:

* ``ours``: the generator's own ``generate`` (per-request seeds, ``logprobs=0``, no
  detokenization, flat log-prob lists where vLLM has them, conversion to tensors);
* ``raw``: seeded requests with ``logprobs=0`` straight to ``LLM.generate`` (vLLM's defaults:
  detokenized, one log-prob dict per token);
* ``nodetok``: ``raw`` without detokenization;
* ``flatlp``: ``nodetok`` with ``flat_logprobs``;
* ``noseed``: without per-request seeds (vLLM samples seeded requests with one generator each);
* ``nologprobs``: without the sampled tokens' log-probs;
* ``bare``: neither seeds nor log-probs;
* ``n1x64``: 64 requests of n=1 instead of 8 of n=8 (no seeds, no log-probs);
* ``static``: this project's ``static`` generator on the same model, for reference.

    python bench/profile_vllm.py --tokens 256 --out $OUT/profile_vllm.json

Prints a table (median of ``--repeats`` after one warm-up) and writes the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from bench._common import build_model, load_tokenizer, out_dir, prompt_texts, write_json
    from grpo_plugins.generators.static_cache import StaticCacheGenerator
    from grpo_plugins.generators.vllm_backend import VLLMGenerator, VLLMGeneratorParams
    from grpo_plugins.kinds import SamplingSettings

    tokenizer = load_tokenizer()
    model = build_model()
    texts = prompt_texts(args.prompts)
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    repeated = [p for p in prompt_ids for _ in range(args.n)]
    sampling = SamplingSettings(max_completion_length=args.tokens, temperature=1.0, seed=42, extra={"ignore_eos": True})

    t0 = time.perf_counter()
    gen = VLLMGenerator(VLLMGeneratorParams(gpu_memory_utilization=args.gpu_memory_utilization))
    gen.setup(model, tokenizer, sampling)
    startup = time.perf_counter() - t0
    vllm = gen._vllm
    llm = gen.llm

    def params(n: int, seed: int | None, logprobs: int | None, **extra: Any) -> Any:
        return vllm.SamplingParams(
            n=n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=logprobs, seed=seed, **extra
        )

    def raw(n: int, seeded: bool, logprobs: int | None, prompts: list[list[int]], **extra: Any) -> Any:
        ps = [params(n, 1000 + i * n if seeded else None, logprobs, **extra) for i in range(len(prompts))]
        return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=ps, use_tqdm=False)

    flat = [p for p in prompt_ids for _ in range(args.n)]
    variants: dict[str, Any] = {
        "ours": lambda: gen.generate(repeated),
        "raw": raw(args.n, True, 0, prompt_ids),
        "nodetok": raw(args.n, True, 0, prompt_ids, detokenize=False),
        "flatlp": raw(args.n, True, 0, prompt_ids, detokenize=False, flat_logprobs=True),
        "noseed": raw(args.n, False, 0, prompt_ids),
        "nologprobs": raw(args.n, True, None, prompt_ids),
        "bare": raw(args.n, False, None, prompt_ids),
        "n1x64": raw(1, False, None, flat),
    }
    results: dict[str, Any] = {
        "shape": "qwen2.5-0.5b", "prompts": args.prompts, "n": args.n, "tokens": args.tokens,
        "engine_startup_s": startup, "vllm": vllm.__version__, "variants": {},
    }
    out = Path(args.out) if args.out else out_dir() / "profile_vllm.json"

    def measure(name: str, fn: Any) -> None:
        fn()  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        results["variants"][name] = {"median_s": statistics.median(times), "times": times}
        print(f"{name:12s} {statistics.median(times):7.3f} s   {times}", flush=True)
        write_json(out, results)

    for name, fn in variants.items():
        measure(name, fn)

    # the prefix cache: the same requests again with it cleared before each call
    measure("bare_nocache", lambda: (llm.reset_prefix_cache(), variants["bare"]()))
    gen.close()
    del llm, gen
    torch.cuda.empty_cache()

    static = StaticCacheGenerator(StaticCacheGenerator.Params(ignore_eos=True))
    static.setup(model, tokenizer, sampling)
    measure("static", lambda: static.generate(repeated))
    print(f"engine start {startup:.1f} s", flush=True)


if __name__ == "__main__":
    main()
