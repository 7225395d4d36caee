"""Could the next batch's generation run while this batch trains? (one GPU, the Engine's own parts)

A decode step at 64 rows is latency-bound (a chain of small kernels leaves most multiprocessors
idle), a training pass is compute-bound. This measures how much of the two overlaps when both
run at once, before building a pipeline that generates batch k+1 while batch k trains (its
samples one optimizer step off-policy, which the importance-sampling correction covers).

It runs bench_grpo.py's workload through the Engine. After ``--warmup`` steps every measured
step's micro-step runs either alone or with a second generation of that step's prompts on a
stream of its own, in a thread (``--priority high`` gives that stream the higher priority);
the two alternate step by step. Per step it records the generation alone (the Engine's own),
the micro-step alone, and the pair at once: the wall time until both finished, and each one's
own time. The micro-step does not change the weights (the optimizer step comes after it), so
both read the same weights, as they would in the pipeline.

    python bench/overlap_step.py --shape qwen2.5-0.5b --tokens 1024 --steps 4 --warmup 2 \\
        [--overrides '{"gradient_checkpointing": false}'] [--priority high] [--train-sms 100]

``--train-sms N`` runs the overlapped micro-step on a stream of a CUDA green context limited to N
multiprocessors (torch's ``torch.cuda.green_contexts``, where it has ``Stream``), so the
training pass's long blocks leave the rest to the decode kernels.

Each overlapped step also records, per decode step, when the host issued it and (by CUDA
events every 16 steps) when the GPU had done it: whether a slow generation beside training
waited on the host (the GIL) or on the GPU.

Writes ``$OUT/overlap_step.json``; ``BENCH_TINY=1`` for a quick CPU check of the script (threads
without streams: no overlap to expect there).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
from bench._common import DEVICE, build_model, gib, length_reward, load_tokenizer, median, out_dir, sync, write_json  # noqa: E402
from bench.bench_grpo import dataset, ours_config  # noqa: E402


def _in_thread(fn: Any, stream: torch.cuda.Stream | None, times: dict[str, float], start: float) -> threading.Thread:
    """Run ``fn`` in a thread (on ``stream`` where given); ``times["own"]`` is its time from
    ``start`` until its stream's work finished."""

    def work() -> None:
        if stream is None:
            fn()
        else:
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()
        times["own"] = time.perf_counter() - start

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def _train_stream(train_sms: int | None) -> torch.cuda.Stream | None:
    """A stream limited to ``train_sms`` multiprocessors (a green context's), or None."""
    if not train_sms or DEVICE != "cuda":
        return None
    from torch.cuda import green_contexts

    context = green_contexts.GreenContext.create(num_sms=train_sms)
    if not hasattr(context, "Stream"):
        raise SystemExit(f"--train-sms: this torch ({torch.__version__}) has no GreenContext.Stream")
    stream = context.Stream()
    stream._green_context = context  # keep the context alive as long as its stream
    return stream


class DecodeProbe:
    """Where a generation's decode steps went while it ran beside training: the host time each
    step was issued, and (every ``every`` steps, by a CUDA event on the decode stream) when the
    GPU had done it. Installed around ``static_decode.decode_windows`` while ``active``."""

    def __init__(self, every: int = 16) -> None:
        self.every, self.active = every, False
        self.issued: list[float] = []
        self.done: list[tuple[int, Any]] = []  # (step, event)
        self.base: tuple[float, Any] | None = None

    def install(self) -> None:
        from grpo_plugins.generators import static_decode

        loop, probe = static_decode.decode_windows, self

        class Timed:
            def __init__(self, graphs: Any) -> None:
                self.graphs, self.states = graphs, graphs.states

            def replay(self, cur: int) -> None:
                self.graphs.replay(cur)
                probe.issued.append(time.perf_counter())
                if DEVICE == "cuda" and len(probe.issued) % probe.every == 0:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    probe.done.append((len(probe.issued), event))

        def probed(graphs: Any, *args: Any, **kwargs: Any) -> int:
            if not probe.active:
                return loop(graphs, *args, **kwargs)
            if DEVICE == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                torch.cuda.current_stream().synchronize()
                probe.base = (time.perf_counter(), event)
            return loop(Timed(graphs), *args, **kwargs)

        static_decode.decode_windows = probed

    def summary(self, start: float, train_end: float) -> dict[str, Any]:
        """Decode steps issued by the host, and done by the GPU, during the training window
        [``start``, ``train_end``] (host clock; the GPU's events aligned at the loop's start)."""
        out: dict[str, Any] = {"steps": len(self.issued), "issued_during_training": sum(start <= t <= train_end for t in self.issued)}
        if self.base is not None and self.done:
            t_base, e_base = self.base
            gpu = [(k, t_base + e_base.elapsed_time(e) / 1000) for k, e in self.done]
            during = [k for k, t in gpu if start <= t <= train_end]
            out["done_by_gpu_during_training"] = (max(during) - min(during) + self.every) if during else 0
            out["gpu_lag_s_at_training_end"] = max((t for k, t in gpu), default=0.0) - self.issued[-1]
        self.issued, self.done, self.base = [], [], None
        return out


def run(T: int, steps: int, warmup: int, overrides: dict[str, Any], priority: str, train_sms: int | None = None) -> dict[str, Any]:
    from grpo_plugins.engine import Engine

    config = {**ours_config(T, steps, warmup, {"name": "static", "params": {}}), **overrides}
    engine = Engine(config, model=build_model(seed=0), tokenizer=load_tokenizer(), rewards=[length_reward], dataset=dataset())
    setup = engine._setup
    rows: list[dict[str, Any]] = []
    stream = torch.cuda.Stream(priority=-1 if priority == "high" else 0) if DEVICE == "cuda" else None
    train_stream = _train_stream(train_sms)
    probe = DecodeProbe()
    probe.install()

    def setup_and_wrap() -> None:
        setup()
        generator, update = engine.generator, engine.update
        generate, micro_step = generator.generate, update.micro_step
        last: dict[str, Any] = {}

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            last["args"], last["kwargs"] = args, kwargs
            sync()
            t0 = time.perf_counter()
            out = generate(*args, **kwargs)
            sync()
            last["generate_s"] = time.perf_counter() - t0
            return out

        def overlapped_micro_step(*args: Any, **kwargs: Any) -> Any:
            n = len(rows) + 1
            sync()
            if n <= warmup or n % 2 == 0:
                t0 = time.perf_counter()
                out = micro_step(*args, **kwargs)
                sync()
                rows.append({"step": n, "mode": "alone", "generate_s": last["generate_s"], "train_s": time.perf_counter() - t0})
                return out
            times: dict[str, float] = {}
            # The decoder itself (not the generator's seeded wrapper, which would move the run's
            # call counter), and its model kept in train mode: the decoder's eval()/train() would
            # flip the training pass's mode (and so its checkpointing) halfway.
            decoder = getattr(generator, "_decoder", None)
            again = decoder.generate if decoder is not None else generate
            model = decoder.model if decoder is not None else None
            if model is not None:
                model.eval = lambda: model  # type: ignore[method-assign]
                model.train = lambda mode=True: model  # type: ignore[method-assign]
            t0 = time.perf_counter()
            probe.active = True
            thread = _in_thread(lambda: again(*last["args"], **last["kwargs"]), stream, times, t0)
            try:
                if train_stream is None:
                    out = micro_step(*args, **kwargs)
                else:
                    train_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(train_stream):
                        out = micro_step(*args, **kwargs)
                    torch.cuda.current_stream().wait_stream(train_stream)
                sync()
                train_own = time.perf_counter() - t0
            finally:
                thread.join()
                probe.active = False
                if model is not None:
                    del model.eval, model.train
            sync()
            rows.append({
                "step": n, "mode": "together", "generate_s": last["generate_s"], "wall_s": time.perf_counter() - t0,
                "train_own_s": train_own, "generate_own_s": times.get("own"), "decode": probe.summary(t0, t0 + train_own),
            })
            return out

        generator.generate = timed_generate
        update.micro_step = overlapped_micro_step

    engine._setup = setup_and_wrap  # type: ignore[method-assign]
    engine.train()
    measured = [r for r in rows if r["step"] > warmup]
    alone = [r for r in measured if r["mode"] == "alone"]
    together = [r for r in measured if r["mode"] == "together"]
    summary: dict[str, Any] = {
        "generate_alone_s": median([r["generate_s"] for r in measured]),
        "train_alone_s": median([r["train_s"] for r in alone]) if alone else None,
        "together_wall_s": median([r["wall_s"] for r in together]) if together else None,
        "together_generate_s": median([r["generate_own_s"] for r in together]) if together else None,
        "together_train_s": median([r["train_own_s"] for r in together]) if together else None,
        # Decode steps the host issued, and the GPU finished, while the training pass ran: few
        # issued means the decode thread was starved on the host (the GIL), issued but not done
        # means the GPU ran the training pass's kernels first.
        "together_decode": [r["decode"] for r in together],
    }
    if summary["train_alone_s"] is not None and summary["together_wall_s"] is not None:
        serial = summary["generate_alone_s"] + summary["train_alone_s"]
        summary["serial_s"] = serial
        summary["saved_s"] = serial - summary["together_wall_s"]
        summary["overlap_of_shorter"] = summary["saved_s"] / min(summary["generate_alone_s"], summary["train_alone_s"])
    summary["peak_gib"] = gib(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else None
    return {"summary": summary, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(common.SHAPES))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="measured steps, alternating alone / together")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--overrides", default="{}", help="JSON config overrides, e.g. '{\"gradient_checkpointing\": false}'")
    parser.add_argument("--priority", choices=["normal", "high"], default="high", help="the overlapped generation's stream priority")
    parser.add_argument("--train-sms", type=int, default=None, help="run the overlapped micro-step on a green context of this many SMs")
    args = parser.parse_args()
    common.ACTIVE_SHAPE = args.shape
    result = run(args.tokens, args.steps, args.warmup, json.loads(args.overrides), args.priority, args.train_sms)
    result["args"] = vars(args)
    result["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(json.dumps(result["summary"], indent=1), flush=True)
    write_json(out_dir() / "overlap_step.json", result)


if __name__ == "__main__":
    main()
