"""Does a decode batch finish sooner as two halves decoded at once on two CUDA streams?

At 64 rows a small model's decode step is mostly fixed per-kernel costs (launch, ramp, tail:
0.5B takes ~1.3 ms per token on an H100 and on an H200 alike, against a ~0.4 ms bandwidth
floor), so the GPU idles in every kernel's ramp and tail. Two decoders of half the rows each,
replaying their CUDA graphs from two threads on two streams, could fill each other's gaps; each
reads the weights once per step, so the weight traffic doubles. This measures, with the
shipped ``static`` decoder (compiled, merged weight copies by its own rule, the fused attention):

* ``whole``: one decoder, ``--rows`` rows: the shipped way;
* ``half``: one decoder of ``--rows / 2`` rows alone (the latency of a half);
* ``two-streams``: two such decoders at once, each in its own thread and stream;
* ``two-serial``: the same two one after the other (what ``max_batch_rows`` does today).

Each timed over ``--tokens`` tokens a row (EOS ignored), median of ``--repeats``; ms per token is
the time over ``--tokens``. The halves sample from the same model as the whole but with their
own random streams, so tokens are not compared.

    python bench/decode_streams.py --shape qwen2.5-0.5b --tokens 1024

Writes ``$OUT/decode_streams.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
from bench._common import DEVICE, gib, out_dir, sync, write_json  # noqa: E402


def _decoder(model: Any, tokens: int) -> Any:
    from grpo_plugins.generators.static_decode import StaticDecoder
    from grpo_plugins.kinds import SamplingSettings

    sampling = SamplingSettings(max_completion_length=tokens, temperature=1.0)
    return StaticDecoder(model, sampling, eos_ids=[0], pad_id=0, stop_at_eos=False)


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _on_streams(decoders: list[Any], prompts: list[list[list[int]]], streams: list[torch.cuda.Stream]) -> None:
    """Each decoder's generate in a thread of its own, on its own stream; returns when all did."""
    errors: list[BaseException] = []

    def work(dec: Any, rows: list[list[int]], stream: torch.cuda.Stream) -> None:
        try:
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                dec.generate(rows)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=args) for args in zip(decoders, prompts, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in streams:
        torch.cuda.default_stream().wait_stream(s)
    if errors:
        raise errors[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(common.SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if DEVICE != "cuda":
        raise SystemExit("decode_streams.py needs a CUDA device")
    common.ACTIVE_SHAPE = args.shape
    model = common.build_model()
    model.train()
    half = args.rows // 2
    prompts = [list(range(10, 10 + args.prompt)) for _ in range(args.rows)]
    halves = [prompts[:half], prompts[half:]]
    whole = _decoder(model, args.tokens)
    parts = [_decoder(model, args.tokens), _decoder(model, args.tokens)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.manual_seed(0)
    whole.generate(prompts)  # compiles and captures, one decoder at a time (capture is not thread-safe)
    for dec, rows in zip(parts, halves):
        dec.generate(rows)
    sync()
    results: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name()}
    results["whole_s"] = _timed(lambda: whole.generate(prompts), args.repeats)
    results["half_s"] = _timed(lambda: parts[0].generate(halves[0]), args.repeats)
    results["two_streams_s"] = _timed(lambda: _on_streams(parts, halves, streams), args.repeats)
    results["two_serial_s"] = _timed(lambda: [dec.generate(rows) for dec, rows in zip(parts, halves)], args.repeats)
    for key in ("whole", "half", "two_streams", "two_serial"):
        results[f"{key}_ms_per_token"] = 1000 * results[f"{key}_s"] / args.tokens
    results["two_streams_against_whole"] = results["two_streams_s"] / results["whole_s"]
    results["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    write_json(out_dir() / "decode_streams.json", results)
    for key, value in results.items():
        if key != "args":
            print(f"{key:28} {value:.4f}" if isinstance(value, float) else f"{key:28} {value}", flush=True)


if __name__ == "__main__":
    main()
