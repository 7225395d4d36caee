"""Find where a non-finite gradient is born.

Trains a config through the Engine and checks every micro-step's gradients. At the first
micro-step that leaves a non-finite gradient it stops training and, on that exact micro-batch:

1. records the batch's attention layout (left-padding, fully masked query rows, length mod 8,
   whether any row has no padding at all) and saves the batch to ``$OUT/nonfinite_batch.pt``;
2. re-runs the micro-step from zero gradients in variants -- as run; eager decoder layers; eager
   log-softmax chunk; both eager; compiled with SDPA forced to the math backend -- and reports
   which leave non-finite gradients;
3. in the as-run variant, hooks every decoder layer and the final norm and reports, from the
   top down, the first module whose input gradient is non-finite while its output gradient is
   finite: where the NaN is born.

    python bench/diagnose_nonfinite.py examples/arithmetic_smollm2_lora_gpu.yaml \
        --set compile_layers=true --set max_steps=120

Writes ``$OUT/nonfinite.json`` and prints it last. Exit status 0 whether or not a non-finite
gradient was found ("found": false then).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import out_dir, write_json  # noqa: E402


class Found(Exception):
    pass


def _finite(grads: list[torch.Tensor | None]) -> bool:
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def _nonfinite_names(engine: Any) -> list[str]:
    return [
        n for n, p in engine.unwrapped.named_parameters()
        if p.requires_grad and p.grad is not None and not bool(torch.isfinite(p.grad).all())
    ]


def _layout(ids: torch.Tensor, att: torch.Tensor, t: int) -> dict[str, Any]:
    att = att.bool()
    P = att.shape[1] - t
    left_pad = (~att[:, :P]).sum(1)  # (B,) pad columns before each prompt
    return {
        "rows": int(att.shape[0]),
        "length": int(att.shape[1]),
        "length_mod_8": int(att.shape[1] % 8),
        "completion_columns": t,
        "rows_without_any_padding": int(att.all(1).sum()),
        "left_pad_columns_max": int(left_pad.max()),
        "left_pad_columns_min": int(left_pad.min()),
        "fully_masked_query_rows": int(left_pad.sum()),
        "completion_tokens": int(att[:, P:].sum()),
    }


def diagnose(engine: Any, micro_step: Any, rollout: Any, step: Any, window_items: float) -> dict[str, Any]:
    """``micro_step``: the run's own (unchecked) ``PolicyUpdate.micro_step``, bound to it."""
    from grpo_plugins.attention import training_passes
    from grpo_plugins.policy import trim_padding
    from grpo_plugins.update import AccumulationWindow

    report: dict[str, Any] = {"found": True, "step": engine.global_step + 1, "micro_step": step.step}
    report["nonfinite_parameters"] = _nonfinite_names(engine)[:20]
    T = rollout.loss_mask.shape[1]
    ids, att, t = trim_padding(rollout.input_ids[step.rows], rollout.attention_mask[step.rows], T)
    report["layout"] = _layout(ids, att, t)
    report["advantages"] = {"min": float(rollout.advantages.min()), "max": float(rollout.advantages.max())}
    report["loss_mask_tokens"] = float(rollout.loss_mask[step.rows].sum())
    torch.save(
        {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in rollout.to_state().items()} | {"rows": step.rows},
        out_dir() / "nonfinite_batch.pt",
    )
    write_json(out_dir() / "nonfinite.partial.json", report)  # in case the variants below run out of time
    print(json.dumps(report, default=str), flush=True)

    policy = engine.update.policy  # what the micro-step's forwards run with
    compiled, chunk = engine.compiled_layers, policy.chunk_fn
    run_layers = policy.layers
    params = [p for p in engine.unwrapped.parameters() if p.requires_grad]

    def run(name: str, layers: Any, chunk_fn: Any, context: Any = contextlib.nullcontext()) -> None:
        for p in params:
            p.grad = None
        policy.layers, policy.chunk_fn = functools.partial(training_passes, layers), chunk_fn
        try:
            window = AccumulationWindow()
            with context:
                micro_step(rollout, step, window_items, window)
            loss = window.losses[0]
            grads = [p.grad for p in params]
            report.setdefault("variants", {})[name] = {
                "loss": float(loss),
                "finite_gradients": _finite(grads),
                "nonfinite_parameters": len(_nonfinite_names(engine)),
            }
        except Exception as exc:  # noqa: BLE001 - a diagnosis reports, it does not stop
            report.setdefault("variants", {})[name] = {"error": repr(exc)[:500]}
        finally:
            policy.layers, policy.chunk_fn = run_layers, chunk

    # Where is it born? Hook the layers in the as-run variant.
    from grpo_plugins.compiled_layers import decoder_layers

    events: list[dict[str, Any]] = []
    modules = [(f"layer{i}", m) for i, m in enumerate(decoder_layers(engine.unwrapped) or [])]
    norm = getattr(engine.unwrapped.get_decoder(), "norm", None)
    if norm is not None:
        modules.append(("final_norm", norm))

    def hook(name: str):
        def fn(module: Any, grad_input: Any, grad_output: Any) -> None:
            def ok(gs: Any) -> bool:
                return all(g is None or bool(torch.isfinite(g).all()) for g in gs)

            events.append({"module": name, "grad_output_finite": ok(grad_output), "grad_input_finite": ok(grad_input)})

        return fn

    handles = [m.register_full_backward_hook(hook(n)) for n, m in modules]
    run("as_run_hooked", compiled, chunk)
    for h in handles:
        h.remove()
    report["backward_order"] = events  # top layer first
    born = [e for e in events if e["grad_output_finite"] and not e["grad_input_finite"]]
    report["born_in"] = born[0]["module"] if born else None

    run("as_run", compiled, chunk)
    run("eager_layers", None, chunk)
    run("eager_chunk", compiled, None)
    run("eager_both", None, None)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    run("eager_both_sdpa_math", None, None, sdpa_kernel([SDPBackend.MATH]))
    run("eager_both_sdpa_efficient", None, None, sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
    if compiled is not None:
        torch._dynamo.reset()
        run("compiled_sdpa_math", compiled, chunk, sdpa_kernel([SDPBackend.MATH]))
        torch._dynamo.reset()
        run("compiled_sdpa_efficient", compiled, chunk, sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
        torch._dynamo.reset()
        run("compiled_again", compiled, chunk)  # freshly compiled: does the NaN come back?
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], help="key=value overrides")
    args = parser.parse_args()

    from grpo_plugins.config import load_config
    from grpo_plugins.engine import Engine

    overrides = list(args.set)
    if not any(item.startswith("output_dir=") for item in overrides):
        overrides.append(f"output_dir={tempfile.mkdtemp(prefix='diag_')}")
    config = load_config(args.config, overrides)
    engine = Engine(config)
    report: dict[str, Any] = {"found": False, "overrides": overrides}
    from grpo_plugins.update import PolicyUpdate

    original = PolicyUpdate.micro_step

    def checked(self: Any, rollout: Any, step: Any, window_items: float, window: Any) -> None:
        original(self, rollout, step, window_items, window)
        grads = [p.grad for p in engine.unwrapped.parameters() if p.requires_grad]
        if not _finite(grads):
            report.update(diagnose(engine, original.__get__(self), rollout, step, window_items))
            raise Found()

    PolicyUpdate.micro_step = checked  # type: ignore[method-assign]
    try:
        result = engine.train()
        report["steps_trained"] = result.global_step
    except Found:
        pass
    except Exception as exc:  # noqa: BLE001
        report["error"] = repr(exc)[:1000]
        report["trace"] = traceback.format_exc()[-3000:]
    finally:
        PolicyUpdate.micro_step = original  # type: ignore[method-assign]
    write_json(out_dir() / "nonfinite.json", report)
    print(json.dumps({k: v for k, v in report.items() if k != "trace"}, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
