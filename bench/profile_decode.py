"""Where the ``static`` generator's decode step spends its time (generation is the
bottleneck; ~2 ms per token at 0.5B × 64 rows against a ~0.4 ms bandwidth floor).

For each variant it builds the model, generates once (compiles, captures the graph), then:

* times ``generate`` of ``--rows`` × ``--tokens`` (full length, EOS ignored): ms per token;
* times one more ``generate`` with its parts outside the decode steps timed: refreshing the
  merged weight copies and the prefill (``outside_decode_s``);
* times bare graph replays (one decode step each) with CUDA events;
* profiles ``--profile-steps`` replays with ``torch.profiler`` and reports the kernels per step,
  their total device time per step and the top kernels.

Variants: ``dynamic`` (the shipped setting: regional compile, symbolic shapes), ``static``
(regional compile per bucket), ``autotune`` (``max-autotune-no-cudagraphs``, per bucket),
``eager`` (no compilation, still one CUDA graph); ``fused`` / ``unmerged``: ``dynamic`` with
``merge_weights`` forced on / off (by default on for LoRA models, and for full fine-tuning where
the copy is small); ``matmul``: ``dynamic`` with the decode attention as torch operations
(RoPE, cache writes, two batched products and a softmax) instead of the Triton kernel
(``fused_attention: false``); ``fp8``: ``dynamic``
decoding from float8 weight copies; ``tuned``: merged weights compiled with max-autotune (Triton
matrix-product templates compete with cuBLAS); ``onewindow``: ``dynamic`` with one attention
window over the whole cache (every step reads all of it, as before attention windows);
``swapped`` / ``pdl``: merged weights with every product by ``bench/pdl_chain.py``'s
swapped-operand Triton kernel, and the same with every kernel of the layer launched with
programmatic dependent launch (the products, the attention, inductor's own kernels);
``kernels`` / ``kernels-nopdl``: the layers as the seven Triton kernels of
``bench/decode_kernels.py`` (not compiled; the head compiled), with and without
programmatic dependent launch (each product's K loop whole, the wait before it);
``kernels-peel`` / ``-pre2`` / ``-pre4``: each product loading its first 1 / 2 / 4 blocks of
weights outside the loop, before it waits for the kernel before (as measured at 43d9c22); ``kernels-wide`` / ``kernels-wide-nopdl``: the
products under the float8 kernel's launch plan (64- and 128-row tiles) instead;
``persistent``: the static generator's ``persistent_layers: true`` (each layer one persistent
kernel, :mod:`grpo_plugins.generators.persistent_layer`: a program per multiprocessor, grid
barriers between the phases), ``persistent-times`` the same stamping the phases' times
(printed: each phase's work and span, each barrier's release), ``persistent-bw128`` /
``-w4`` / ``-s3`` with 128-key attention blocks, 4 warps per program, 3 pipeline stages,
``persistent-phases`` its phases as seven launches without barriers; ``parts2`` / ``parts4``:
``dynamic`` with the static generator's ``parallel_parts`` (the batch as 2 / 4 parts decoded at
once on streams of their own; the graph-replay profile is of the first part's graphs alone).

    python bench/profile_decode.py --shape qwen2.5-0.5b --tokens 256 --variants dynamic static eager

Writes ``$OUT/profile_decode.json``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench._common as common  # noqa: E402
from bench._common import DEVICE, gib, out_dir, sync, write_json  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "dynamic": {"compile": True, "dynamic": True, "mode": None},
    "static": {"compile": True, "dynamic": False, "mode": None},
    "autotune": {"compile": True, "dynamic": False, "mode": "max-autotune-no-cudagraphs"},
    "eager": {"compile": False},
    "fused": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True},
    "unmerged": {"compile": True, "dynamic": True, "mode": None, "merge_weights": False},
    "fp8": {"compile": True, "dynamic": True, "mode": None, "fp8": True},
    "tuned": {"compile": True, "dynamic": True, "mode": "max-autotune-no-cudagraphs", "merge_weights": True},
    "onewindow": {"compile": True, "dynamic": True, "mode": None, "window_step": 1 << 30},
    "matmul": {"compile": True, "dynamic": True, "mode": None, "fused_attention": False},
    "swapped": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "swapped": True, "pdl": False},
    "pdl": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "swapped": True, "pdl": True},
    "kernels": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": True},
    "kernels-peel": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": True, "peel": True},
    "kernels-pre2": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": True, "peel": True, "pre": 2},
    "kernels-pre4": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": True, "peel": True, "pre": 4},
    "kernels-wide": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": True, "plan": "wide"},
    "kernels-wide-nopdl": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": False, "plan": "wide"},
    "kernels-nopdl": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "kernels": True, "pdl": False},
    "persistent": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": False},
    "persistent-times": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": False, "times": True},
    "persistent-bw128": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": False, "block_w": 128},
    "persistent-w4": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": False, "warps": 4},
    "persistent-s3": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": False, "stages": 3},
    "persistent-phases": {"compile": True, "dynamic": True, "mode": None, "merge_weights": True, "persistent": True, "phases": True},
    "parts2": {"compile": True, "dynamic": True, "mode": None, "parallel_parts": 2},
    "parts4": {"compile": True, "dynamic": True, "mode": None, "parallel_parts": 4},
}


def _decoder(model: Any, tokens: int, variant: dict[str, Any]) -> Any:
    from grpo_plugins.generators.static_decode import StaticDecoder, decode_head, decode_layer, decode_step
    from grpo_plugins.kinds import SamplingSettings

    sampling = SamplingSettings(max_completion_length=tokens, temperature=1.0)
    dec = StaticDecoder(
        model, sampling, eos_ids=[0], pad_id=0, compile=False, stop_at_eos=False,
        merge_weights=variant.get("merge_weights"), fp8=variant.get("fp8", False),
        window_step=variant.get("window_step", 128), fused_attention=variant.get("fused_attention"),
        parallel_parts=variant.get("parallel_parts", 1),
    )
    layer_fn = decode_layer
    if variant.get("swapped"):
        from bench.pdl_chain import make_decode_layer

        layer_fn = make_decode_layer(variant["pdl"])
    if variant.get("persistent"):  # each layer one persistent kernel (or its phases as 7 launches); the head compiled
        from grpo_plugins.generators import persistent_layer
        from grpo_plugins.generators.persistent_layer import persistent_decode_head, persistent_decode_layer

        persistent_layer.TIMES = variant.get("times", False)
        persistent_layer.BLOCK_W = variant.get("block_w", 64)
        persistent_layer.NUM_WARPS = variant.get("warps", 8)
        persistent_layer.NUM_STAGES = variant.get("stages", 4)
        if not variant["phases"]:  # the setting itself, with its check at first use
            dec.persistent_layers, dec.compile = True, bool(variant.get("compile"))
            return dec
        head = torch.compile(persistent_decode_head, fullgraph=True, dynamic=True) if variant.get("compile") else persistent_decode_head
        dec._compiled_step = functools.partial(
            decode_step, layer_fn=functools.partial(persistent_decode_layer, phases=True), head_fn=head
        )
        return dec
    if variant.get("kernels"):  # the layers as Triton kernels, not compiled; the head compiled
        from bench import decode_kernels
        from bench.decode_kernels import kernel_decode_head, kernel_decode_layer

        decode_kernels.PRE_BLOCKS = variant.get("pre", 1)
        decode_kernels.PLAN = variant.get("plan", "waves")
        decode_kernels.PEEL = variant.get("peel", False)

        head = functools.partial(kernel_decode_head, pdl=variant["pdl"])
        head = torch.compile(head, fullgraph=True, dynamic=True) if variant.get("compile") else head
        dec._compiled_step = functools.partial(
            decode_step, layer_fn=functools.partial(kernel_decode_layer, pdl=variant["pdl"]), head_fn=head
        )
        return dec
    if variant.get("compile"):
        kw: dict[str, Any] = {"fullgraph": True, "dynamic": variant["dynamic"]}
        if variant.get("mode"):
            kw["mode"] = variant["mode"]
        if variant.get("pdl"):
            kw["options"] = {"triton.enable_pdl": True}
        dec._compiled_step = functools.partial(
            decode_step, layer_fn=torch.compile(layer_fn, **kw), head_fn=torch.compile(decode_head, **kw)
        )
    elif layer_fn is not decode_layer:
        dec._compiled_step = functools.partial(decode_step, layer_fn=layer_fn)
    return dec


def _kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    rows = []
    total_us = 0.0
    count = 0
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0.0)
        if dev_us <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total_us += dev_us
        count += evt.count
        rows.append({"name": evt.key[:120], "per_step": evt.count / steps, "us_per_step": dev_us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernels_per_step": count / steps, "device_us_per_step": total_us / steps, "top": rows[:25]}


def _time_outside_decode(dec: Any, prompts: list[list[int]]) -> dict[str, float]:
    """One more ``generate``, with the parts a call runs besides its decode steps timed
    (synchronised): bringing the merged weight copies up to date, and the prompt's prefill."""
    import grpo_plugins.generators.static_decode as static_decode

    spent = {"refresh_weights_s": 0.0, "prefill_s": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[key] += time.perf_counter() - t0
            return out

        return call

    decode_parts, prefill = dec._decode_parts, static_decode.prefill_distinct
    dec._decode_parts = timed("refresh_weights_s", decode_parts)
    static_decode.prefill_distinct = timed("prefill_s", prefill)
    try:
        sync()
        t0 = time.perf_counter()
        dec.generate(prompts)
        sync()
        spent["generate_s"] = time.perf_counter() - t0
    finally:
        dec._decode_parts, static_decode.prefill_distinct = decode_parts, prefill
    return spent


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()
    model = common.build_model()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", lora_dropout=0.0)
        )
    model.train()
    dec = _decoder(model, args.tokens, VARIANTS[name])
    prompts = [list(range(10, 10 + args.prompt)) for _ in range(args.rows)]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    first = dec.generate(prompts)
    sync()
    first_s = time.perf_counter() - t0
    # The same model and seed in every variant: variants that compute the same numbers sample the
    # same tokens (a check that e.g. a launch setting changed no result).
    digest = hashlib.sha256(first[0].cpu().numpy().tobytes()).hexdigest()[:16]
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        dec.generate(prompts)
        sync()
        times.append(time.perf_counter() - t0)
    record: dict[str, Any] = {
        "first_generate_s": first_s,
        "tokens_digest": digest,
        "generate_s": sorted(times)[len(times) // 2],
        "ms_per_token": 1000 * sorted(times)[len(times) // 2] / args.tokens,
        "outside_decode_s": _time_outside_decode(dec, prompts),
    }
    if DEVICE == "cuda":
        graph = next(iter(dec._graphs.values()))
        st = graph.states[0]  # (with parallel parts a replay steps every part; the no-graph step below is part 0's)
        P = st.k_cache[0].shape[2] - args.tokens  # the prompt bucket

        def rewind() -> None:  # keep the cache index and output column inside the buffers
            for part in graph.states:
                part.cur.fill_(P)
                part.step.fill_(1)

        assert args.profile_steps + 5 < args.tokens, "--profile-steps must stay below --tokens"
        rewind()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay(P)  # the first attention window
        start.record()
        for _ in range(args.profile_steps):
            graph.replay(P)  # the first attention window
        end.record()
        sync()
        record["replay_ms_per_step"] = start.elapsed_time(end) / args.profile_steps
        rewind()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                graph.replay(P)  # the first attention window
            sync()
        record["graph_replay"] = _kernel_table(prof, args.profile_steps)
        # The same step without the graph: kernel launches issued by the host.
        step = dec._step_fn()
        call = functools.partial(step, dec._decode_parts(), st, dec.sampling, dec.pad_id, False)
        with torch.no_grad():
            rewind()
            call()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                call()
            sync()
            record["no_graph_ms_per_step"] = 1000 * (time.perf_counter() - t0) / args.profile_steps
            rewind()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof2:
                for _ in range(args.profile_steps):
                    call()
                sync()
        record["no_graph"] = _kernel_table(prof2, args.profile_steps)
        record["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    del dec, model
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(common.SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["dynamic", "static", "eager"], choices=sorted(VARIANTS))
    args = parser.parse_args()
    common.ACTIVE_SHAPE = args.shape
    results: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    path = out_dir() / "profile_decode.json"
    for name in args.variants:
        try:
            results[name] = run_variant(name, args)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next variant
            results[name] = {"error": repr(exc)[:2000]}
        write_json(path, results)
        summary = {k: v for k, v in results[name].items() if not isinstance(v, dict)}
        print(name, summary, flush=True)
        digests = {v.get("tokens_digest") for k, v in results.items() if k in VARIANTS and "tokens_digest" in v}
        if len(results) > 3:
            print(f"  tokens {'the same as' if len(digests) == 1 else 'NOT all the same as'} the variants before", flush=True)
        for part in ("graph_replay", "no_graph"):
            table = results[name].get(part)
            if table:
                print(f"  {part}: {table['kernels_per_step']:.0f} kernels/step, {table['device_us_per_step']:.0f} us/step")
                for row in table["top"][:12]:
                    print(f"    {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['name']}")
        if VARIANTS.get(name, {}).get("times"):
            from grpo_plugins.generators.persistent_layer import phase_times

            results[name]["phase_times_us"] = phase_times()
            write_json(path, results)
            for phase, row in results[name]["phase_times_us"].items():
                print(f"    {phase:<10} " + "  ".join(f"{k} {v:6.2f} us" for k, v in row.items()), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
