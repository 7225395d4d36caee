"""GPU check of the static generator's ``parallel_parts`` (parts of a batch decoded at once as
parallel branches of one CUDA graph per step, each part with its own KV cache):

* greedy decoding (top-k 1) with 2 and 4 parts at once gives the same tokens as the same parts
  decoded one after another (``max_batch_rows``: the same shapes, so the same kernels);
* sampling: parts given the same prompts sample different tokens (each random kernel of the
  graph has its own offset), and the same torch seed gives the same tokens again (a run's seed
  fixes the samples), also where a group's last part decodes alone;
* the time of a generation with 1, 2 and 4 parts (``--tokens`` each, EOS ignored).

    python bench/check_parallel_parts.py --shape qwen2.5-0.5b --tokens 256 --out $OUT/parallel_parts.json

Exits 1 where a check fails. Prints each stage as it starts, so that a hang shows where.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
from bench._common import DEVICE, sync  # noqa: E402


def _decoder(model: Any, tokens: int, parts: int, max_batch_rows: int | None = None, **sampling: Any) -> Any:
    from grpo_plugins.generators.static_decode import StaticDecoder
    from grpo_plugins.kinds import SamplingSettings

    settings = SamplingSettings(max_completion_length=tokens, **sampling)
    return StaticDecoder(
        model, settings, eos_ids=[0], pad_id=0, stop_at_eos=False, parallel_parts=parts, max_batch_rows=max_batch_rows
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(common.SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if DEVICE != "cuda":
        raise SystemExit("check_parallel_parts.py needs a CUDA device")
    common.ACTIVE_SHAPE = args.shape
    model = common.build_model()
    model.train()
    prompts = [list(range(10 + r % 7, 10 + r % 7 + args.prompt)) for r in range(args.rows)]
    same = [list(range(10, 10 + args.prompt))] * args.rows
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name()}
    failed: list[str] = []

    def stage(name: str) -> None:
        print(f"{time.perf_counter() - t0:7.1f} s  {name}", flush=True)

    t0 = time.perf_counter()
    for n in (2, 4):  # parts at once against the same parts one after another (same shapes, same kernels)
        stage(f"greedy, {n} parts at once and one after another")
        together = _decoder(model, 32, n, top_k=1).generate(prompts)[0]
        serial = _decoder(model, 32, 1, top_k=1, max_batch_rows=-(-args.rows // n)).generate(prompts)[0]
        equal = bool(torch.equal(together, serial))
        record[f"greedy_{n}_parts_equal_serial"] = equal
        if not equal:
            failed.append(f"greedy tokens with {n} parts at once differ from the same parts one after another")

    stage("sampling, 2 parts, twice from one seed")
    sampler = _decoder(model, 32, 2, temperature=1.0)
    torch.manual_seed(0)
    first = sampler.generate(same)[0]
    half = args.rows // 2
    apart = bool((first[:half] != first[half : 2 * half]).any())
    torch.manual_seed(0)
    again = sampler.generate(same)[0]
    record["parts_sample_apart"] = apart
    record["same_seed_same_tokens"] = bool(torch.equal(first, again))
    if not apart:
        failed.append("two parts given the same prompts sampled the same tokens")
    if not record["same_seed_same_tokens"]:
        failed.append("the same seed gave other tokens")
    # Three parts of rows // 4 in groups of two: the last group is one part on its own state.
    stage("sampling, a lone last part, twice from one seed")
    lone = _decoder(model, 32, 2, temperature=1.0, max_batch_rows=args.rows // 4)
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(lone.generate(same[: 3 * (args.rows // 4)])[0])
    record["lone_last_part_same_seed_same_tokens"] = bool(torch.equal(*draws))
    if not record["lone_last_part_same_seed_same_tokens"]:
        failed.append("a lone last part gave other tokens for the same seed")

    for n in (1, 2, 4):
        stage(f"timing {n} part(s)")
        dec = _decoder(model, args.tokens, n, temperature=1.0)
        dec.generate(prompts)  # compile and capture
        times = []
        for _ in range(3):
            sync()
            started = time.perf_counter()
            dec.generate(prompts)
            sync()
            times.append(time.perf_counter() - started)
        record[f"ms_per_token_{n}_parts"] = 1000 * sorted(times)[1] / args.tokens
        print(f"{n} part(s): {record[f'ms_per_token_{n}_parts']:.3f} ms per token", flush=True)
        del dec
        torch.cuda.empty_cache()
    record["failed"] = failed
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    print("FAILED: " + "; ".join(failed) if failed else "ok")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
