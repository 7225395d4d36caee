"""Does a decode batch finish sooner as parts decoded at once on several CUDA streams?

At 64 rows a small model's decode step is mostly fixed per-kernel costs (launch, ramp, tail:
0.5B takes ~1.3 ms per token on an H100 and on an H200 alike, against a ~0.4 ms bandwidth
floor), so the GPU idles in every kernel's ramp and tail. Two decoders of half the rows each,
replaying their CUDA graphs from two threads on two streams, could fill each other's gaps; each
reads the weights once per step, so the weight traffic doubles. This measures, with the
shipped ``static`` decoder (compiled, merged weight copies by its own rule, the fused attention):

* ``whole``: one decoder, ``--rows`` rows: the shipped way;
* for each N of ``--parts``: one decoder of ``--rows / N`` rows alone (``part_alone``, a part's
  latency); N such decoders at once, each in its own thread and stream (``streams``); the same
  one after the other (``serial``, what ``max_batch_rows`` does today).

Each timed over ``--tokens`` tokens a row (EOS ignored), median of ``--repeats``; ms per token is
the time over ``--tokens``. Each part's graphs are captured with a random state of their own
(``Generator.graphsafe_set_state``), so that replays at once do not race on one generator's
offset; ``parts_sample_apart`` checks that parts given the same prompts sample different tokens.

    python bench/decode_streams.py --shape qwen2.5-0.5b --tokens 1024 --parts 2 4

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


def _on_streams(
    decoders: list[Any], prompts: list[list[list[int]]], streams: list[torch.cuda.Stream], outputs: list[Any] | None = None
) -> None:
    """Each decoder's generate in a thread of its own, on its own stream; returns when all did
    (their outputs appended to ``outputs`` in the decoders' order, if given)."""
    errors: list[BaseException] = []
    results: list[Any] = [None] * len(decoders)

    def work(i: int, dec: Any, rows: list[list[int]], stream: torch.cuda.Stream) -> None:
        try:
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                results[i] = dec.generate(rows)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, *args)) for i, args in enumerate(zip(decoders, prompts, streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in streams:
        torch.cuda.default_stream().wait_stream(s)
    if errors:
        raise errors[0]
    if outputs is not None:
        outputs.extend(results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(common.SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", type=int, nargs="+", default=[2], help="how many parts (and streams) to try")
    args = parser.parse_args()
    if DEVICE != "cuda":
        raise SystemExit("decode_streams.py needs a CUDA device")
    common.ACTIVE_SHAPE = args.shape
    model = common.build_model()
    model.train()
    prompts = [list(range(10, 10 + args.prompt)) for _ in range(args.rows)]
    whole = _decoder(model, args.tokens)
    torch.manual_seed(0)
    whole.generate(prompts)  # compiles and captures
    results: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name()}
    results["whole_s"] = _timed(lambda: whole.generate(prompts), args.repeats)
    print(f"whole: {args.rows} rows {1000 * results['whole_s'] / args.tokens:.3f} ms/token", flush=True)
    for n in args.parts:
        size = -(-args.rows // n)
        chunks = [prompts[i : i + size] for i in range(0, args.rows, size)]
        parts = [_decoder(model, args.tokens) for _ in chunks]
        streams = [torch.cuda.Stream() for _ in chunks]
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        for i, (dec, rows) in enumerate(zip(parts, chunks)):  # capture one at a time (capture is not thread-safe)
            # Each part's graphs draw from a random state of their own (registered at capture), so
            # replays at once on two streams do not race on one generator's offset.
            state = gen.clone_state()
            state.manual_seed(1000 + i)
            saved = gen.graphsafe_get_state()
            gen.graphsafe_set_state(state)
            try:
                dec.generate(rows)
            finally:
                gen.graphsafe_set_state(saved)
        sync()
        row = {
            "part_alone_s": _timed(lambda: parts[0].generate(chunks[0]), args.repeats),
            "streams_s": _timed(lambda: _on_streams(parts, chunks, streams), args.repeats),
            "serial_s": _timed(lambda: [dec.generate(rows) for dec, rows in zip(parts, chunks)], args.repeats),
        }
        row.update({k.replace("_s", "_ms_per_token"): 1000 * v / args.tokens for k, v in list(row.items())})
        outs = []  # the same prompts in every part: parts with random states of their own sample apart
        _on_streams(parts, chunks, streams, outs)
        row["parts_sample_apart"] = bool((outs[0][0][: len(chunks[-1])] != outs[1][0][: len(chunks[-1])]).any()) if len(outs) > 1 else None
        row["streams_against_whole"] = row["streams_s"] / results["whole_s"]
        results[f"parts{n}"] = row
        print(f"{n} parts of {size} rows: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        parts.clear()  # the decoders, their caches and graphs
        torch.cuda.empty_cache()
    results["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    write_json(out_dir() / "decode_streams.json", results)


if __name__ == "__main__":
    main()
