"""Micro-benchmark of the generation backends and of the chunked log-probs, on one GPU.

    python bench/bench_generator.py --tokens 256 1024

1. correctness on the GPU: greedy tokens of ``static`` vs ``model.generate``; its sampling
   log-probs vs a teacher-forced forward pass; two sampled batches differ;
2. seconds per generation batch (64 prompts x T tokens), median of repeats after warm-up, for
   each ``static`` variant (compiled + CUDA graph, eager + CUDA graph) and for ``model.generate``
   (the ``transformers`` backend);
3. peak memory and time of forward + backward through ``completion_logps`` (chunked) vs full
   logits + log-softmax, with gradient checkpointing, at each T.

Writes ``$OUT/gen_bench.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    DEVICE,
    build_model,
    gib,
    load_tokenizer,
    median,
    out_dir,
    peak,
    prompt_texts,
    reset_peak,
    sync,
    timed,
    write_json,
)
from grpo_plugins.kinds import SamplingSettings  # noqa: E402
from grpo_plugins.registry import get_registry  # noqa: E402

RESULTS: dict[str, Any] = {"errors": []}
WANTED: set[str] = {"compile", "eager", "hf"}  # --variants


def log(msg: str) -> None:
    print(msg, flush=True)


def section(name: str):
    def wrap(fn):
        def run(*a, **k):
            log(f"== {name}")
            try:
                return fn(*a, **k)
            except Exception as exc:  # keep measuring the rest; report the failure
                RESULTS["errors"].append({"section": name, "error": repr(exc), "trace": traceback.format_exc()})
                log(f"!! {name} failed: {exc!r}\n{traceback.format_exc()}")
                return None
            finally:
                write_json(out_dir() / "gen_bench.json", RESULTS)

        return run

    return wrap


def prompts_ids(tokenizer: Any, n_unique: int = 8, repeats: int = 8) -> list[list[int]]:
    texts = prompt_texts(n_unique)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [ids[i // repeats] for i in range(n_unique * repeats)]


def make_generator(model: Any, tokenizer: Any, T: int, params: dict | None, name: str = "static", **sampling: Any):
    gen = get_registry().build("generator", name, params)
    gen.setup(model, tokenizer, SamplingSettings(max_completion_length=T, **sampling))
    return gen


@section("correctness")
def correctness(model: Any, tokenizer: Any, prompts: list[list[int]], T: int) -> None:
    """Greedy tokens (eager + graph: a greedy compiled graph would be one more compilation) and
    sampling log-probs vs a teacher-forced forward pass for both variants at the timed shape."""
    from grpo_plugins.data import left_pad

    out: dict[str, Any] = {}
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, device=DEVICE)
    fast = make_generator(model, tokenizer, 32, {"compile": False}, top_k=1).generate(prompts).completion_ids
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )[:, ids.shape[1] :]
    width = min(fast.shape[1], ref.shape[1])
    same = (fast[:, :width] == ref[:, :width]).float()
    prefix = same.cumprod(dim=1).sum(dim=1)  # bf16 near-ties may legitimately diverge later
    out["greedy_eager_graph_vs_generate"] = {
        "first_token_agreement": same[:, 0].mean().item(),
        "token_agreement": same.mean().item(),
        "mean_identical_prefix": prefix.mean().item(),
        "rows_identical": (prefix == width).float().mean().item(),
        "width": width,
    }
    log(f"greedy: {out['greedy_eager_graph_vs_generate']}")
    for variant, params in {"compile_graph": {"compile": True}, "eager_graph": {"compile": False}}.items():
        sampled = make_generator(model, tokenizer, T, params)
        a = sampled.generate(prompts)
        b = sampled.generate(prompts)
        full = torch.cat([ids, a.completion_ids], dim=1)
        att = torch.cat([mask, a.completion_mask], dim=1)
        with torch.no_grad():
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            logits = (
                model(input_ids=full, attention_mask=att, position_ids=pos).logits[:, ids.shape[1] - 1 : -1].float()
            )
        teacher = logits.log_softmax(-1).gather(2, a.completion_ids[..., None]).squeeze(-1)
        m = a.completion_mask.bool()
        diff = (teacher - a.sampling_logps).abs()[m]
        out[variant] = {
            "logp_abs_diff_mean": diff.mean().item(),
            "logp_abs_diff_max": diff.max().item(),
            "teacher_logp_mean": teacher[m].mean().item(),
            "sampling_logp_mean": a.sampling_logps[m].mean().item(),
            "two_batches_identical_fraction": (a.completion_ids == b.completion_ids).float().mean().item(),
            "mean_length": a.completion_mask.sum(1).float().mean().item(),
        }
        log(f"sampled {variant}: {out[variant]}")
        del logits
    RESULTS["correctness"] = out


@section("generation timing")
def generation_timing(model: Any, tokenizer: Any, prompts: list[list[int]], T: int, repeats: int, hf: bool) -> None:
    rows: dict[str, Any] = RESULTS.setdefault("generation", {}).setdefault(str(T), {})
    variants: dict[str, tuple[str, dict]] = {
        "static compile+graph": ("static", {"compile": True}),
        "static eager+graph": ("static", {"compile": False}),
    }
    if hf:
        variants["transformers (model.generate)"] = ("transformers", None)
    variants = {
        k: v
        for k, v in variants.items()
        if k.split()[1].split("+")[0] in WANTED or "hf" in WANTED and v[0] == "transformers"
    }
    for label, (name, params) in variants.items():
        try:
            gen = make_generator(model, tokenizer, T, params, name=name)
            base = reset_peak()
            _, t_first = timed(lambda: gen.generate(prompts))
            times = []
            n_rep = repeats if name == "static" else 1
            for _ in range(n_rep):
                out, t = timed(lambda: gen.generate(prompts))
                times.append(t)
            tokens = int(out.completion_mask.sum())
            rows[label] = {
                "first_call_s": t_first,
                "median_s": median(times),
                "times": times,
                "completion_tokens": tokens,
                "tokens_per_s": tokens / median(times),
                "peak_extra_gib": gib(peak() - base),
                "mean_length": out.completion_mask.sum(1).float().mean().item(),
            }
            log(f"T={T} {label}: {rows[label]}")
            gen = out = None  # free before the next variant
        except Exception as exc:
            rows[label] = {"error": repr(exc)}
            RESULTS["errors"].append(
                {"section": f"gen {label} {T}", "error": repr(exc), "trace": traceback.format_exc()}
            )
            log(f"!! {label} T={T}: {exc!r}\n{traceback.format_exc()}")
        write_json(out_dir() / "gen_bench.json", RESULTS)


@section("log-prob memory")
def logprob_memory(model: Any, tokenizer: Any, prompts: list[list[int]], T: int) -> None:
    from grpo_plugins.data import left_pad
    from grpo_plugins.logprobs import completion_logps
    from grpo_plugins.models import enable_gradient_checkpointing

    rows: dict[str, Any] = RESULTS.setdefault("logprobs", {}).setdefault(str(T), {})
    enable_gradient_checkpointing(model)
    model.train()
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, device=DEVICE)
    completion = torch.randint(0, 49152, (ids.shape[0], T), device=DEVICE)
    full = torch.cat([ids, completion], 1)
    att = torch.cat([mask, torch.ones_like(completion)], 1)

    def chunked() -> None:
        logps, ent = completion_logps(model, full, att, T, with_entropy=True)
        (logps.float().mean() + 0 * ent.float().mean()).backward()

    def naive() -> None:
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=full, attention_mask=att, position_ids=pos).logits[:, -T - 1 : -1].float()
        logps = logits.log_softmax(-1).gather(2, completion[..., None]).squeeze(-1)
        logps.mean().backward()

    for label, fn in (("chunked completion_logps", chunked), ("full logits", naive)):
        model.zero_grad(set_to_none=True)
        reset_peak()
        fn()  # warm-up (allocates the gradients)
        sync()
        base = reset_peak()
        times = [timed(fn)[1] for _ in range(3)]
        rows[label] = {
            "median_s": median(times),
            "peak_gib": gib(peak()),
            "peak_above_weights_and_grads_gib": gib(peak() - base),
        }
        log(f"T={T} {label}: {rows[label]}")
    model.zero_grad(set_to_none=True)
    model.eval()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


def table() -> str:
    lines = ["", "generation: 64 completions (8 prompts x 8), seconds per batch (median)", ""]
    lines.append(f"{'T':>5}  {'backend':<32} {'first call s':>12} {'median s':>9} {'tok/s':>9} {'peak+ GiB':>9}")
    for T, rows in RESULTS.get("generation", {}).items():
        for label, r in rows.items():
            if "error" in r:
                lines.append(f"{T:>5}  {label:<32} ERROR {r['error'][:60]}")
            else:
                lines.append(
                    f"{T:>5}  {label:<32} {r['first_call_s']:>12.2f} {r['median_s']:>9.3f} "
                    f"{r['tokens_per_s']:>9.0f} {r['peak_extra_gib']:>9.2f}"
                )
    lines += ["", "log-probs fwd+bwd (gradient checkpointing), 64 rows", ""]
    for T, rows in RESULTS.get("logprobs", {}).items():
        for label, r in rows.items():
            lines.append(
                f"{T:>5}  {label:<32} {r['median_s']:>9.3f} s  peak {r['peak_gib']:.2f} GiB  (+{r['peak_above_weights_and_grads_gib']:.2f})"
            )
    if RESULTS["errors"]:
        lines += ["", f"{len(RESULTS['errors'])} error(s): see gen_bench.json"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip model.generate timings")
    parser.add_argument("--hf-max-tokens", type=int, default=1024)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-logprobs", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--variants", nargs="+", default=["compile", "eager", "hf"], help="compile, eager, hf")
    args = parser.parse_args()
    WANTED.clear()
    WANTED.update(args.variants)
    torch.backends.cuda.matmul.allow_tf32 = True
    RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    RESULTS["torch"] = torch.__version__
    tokenizer = load_tokenizer()
    model = build_model().eval()
    prompts = prompts_ids(tokenizer)
    RESULTS["prompt_lengths"] = sorted({len(p) for p in prompts})
    if not args.skip_correctness:
        correctness(model, tokenizer, prompts, args.tokens[0])
    for T in [] if args.skip_generation else args.tokens:
        generation_timing(model, tokenizer, prompts, T, args.repeats, hf=not args.no_hf and T <= args.hf_max_tokens)
    if not args.skip_logprobs:
        for T in args.tokens:
            logprob_memory(model, tokenizer, prompts, T)
    write_json(out_dir() / "gen_bench.json", RESULTS)
    print(table(), flush=True)


if __name__ == "__main__":
    main()
