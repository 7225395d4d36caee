"""GPU check of float16 training's gradient scaler: its skip path runs.

A float16 run whose scaler starts at 2**40 (torch's default is 2**16): the first steps' scaled
gradients overflow, the scaler skips those optimizer steps and halves its scale until the
gradients fit, and training then goes on. Prints ``loss_scale`` and ``scaler_skipped`` per step
and checks that the parameters did not move on the skipped steps.

    python bench/check_fp16_scaler.py examples/arithmetic_smollm2_lora_gpu.yaml --steps 30
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--init-scale", type=float, default=2.0**40)
    args = parser.parse_args()

    import grpo_plugins.engine as engine_module
    from bench._common import out_dir, write_json
    from grpo_plugins.config import load_config
    from grpo_plugins.metrics import read_metrics

    make = engine_module.make_accelerator

    def make_with_scale(*a: Any, **k: Any) -> Any:
        acc, plan = make(*a, **k)
        acc.scaler._init_scale = args.init_scale  # read when the scaler first scales a loss
        return acc, plan

    engine_module.make_accelerator = make_with_scale
    out = tempfile.mkdtemp(prefix="fp16_")
    config = load_config(args.config, ["dtype=float16", f"max_steps={args.steps}", "save_steps=1000",
                                       f"output_dir={out}", "report_to=[jsonl]"])
    engine = engine_module.Engine(config)
    snapshots: list[torch.Tensor] = []
    update = engine_module.PolicyUpdate.optimizer_step

    def step(self: Any, *a: Any, **k: Any) -> Any:
        record = update(self, *a, **k)
        snapshots.append(torch.cat([p.detach().float().flatten()[:4096] for p in engine.trainable]).cpu())
        return record

    engine_module.PolicyUpdate.optimizer_step = step
    engine.train()
    rows = read_metrics(Path(out))
    report = []
    for i, r in enumerate(rows):
        moved = None if i == 0 else float((snapshots[i] - snapshots[i - 1]).abs().max())
        report.append({"step": r["step"], "loss_scale": r.get("loss_scale"), "scaler_skipped": r.get("scaler_skipped"),
                       "max_param_change": moved, "grad_norm": r.get("grad_norm"), "reward": r.get("reward")})
        print(json.dumps(report[-1]), flush=True)
    skipped = [r for r in report if r["scaler_skipped"]]
    summary = {"steps": len(report), "skipped": len(skipped),
               "skipped_steps_moved_params": [r["step"] for r in skipped if r["max_param_change"]],
               "final_scale": report[-1]["loss_scale"]}
    write_json(out_dir() / "fp16_scaler.json", {"summary": summary, "steps": report})
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
