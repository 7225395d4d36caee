"""Training metrics: the per-step statistics (docs/engine.md) and where they are written.

:func:`reward_metrics` and :func:`completion_metrics` turn a gathered generation batch into
TRL-named metrics; :class:`MetricsWriter` sends each logged step to the console
(:mod:`grpo_plugins.console`), ``metrics.jsonl`` (one JSON object per line, flushed per line) and
TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
TENSORBOARD_DIR = "tensorboard"


def reward_metrics(
    rewards_per_func: Tensor, names: list[str], weights: list[float], num_generations: int
) -> dict[str, float]:
    """TRL's reward metrics of one generation batch.

    Args:
        rewards_per_func: (N, K) rewards of the whole (gathered) batch; NaN = not applicable.
        names: the K reward names.
        weights: the K reward weights.
        num_generations: G; groups are consecutive rows.

    Returns ``reward`` (mean weighted reward), ``reward_std`` (mean of the group stds, as TRL),
    ``frac_reward_zero_std`` and ``rewards/<name>/mean`` and ``/std`` for each reward.
    """
    import torch

    from grpo_plugins.advantages import combine_rewards, nan_std

    r = rewards_per_func.detach().double().cpu()  # (N, K)
    combined = combine_rewards(r, weights)  # (N,) NaN where no reward applies
    groups = combined.view(-1, num_generations)  # (N/G, G)
    group_std = nan_std(groups, dim=1)  # (N/G,)
    out: dict[str, float] = {
        "reward": _finite(combined.nanmean()),
        "reward_std": _finite(group_std.nanmean()),
        "frac_reward_zero_std": float(torch.isclose(group_std.nan_to_num(0.0), torch.zeros((), dtype=group_std.dtype)).double().mean()),
    }
    for k, name in enumerate(names):
        col = r[:, k]
        out[f"rewards/{name}/mean"] = _finite(col.nanmean())
        out[f"rewards/{name}/std"] = _finite(nan_std(col, dim=0))
    return out


def completion_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
    """Length statistics of a (gathered) generation batch.

    Args:
        lengths: (N,) completion lengths in tokens (EOS included).
        truncated: (N,) bool, True where the completion hit max_completion_length.
    """
    lengths = lengths.detach().double().cpu()
    truncated = truncated.detach().bool().cpu()
    terminated = lengths[~truncated]
    return {
        "completions/mean_length": float(lengths.mean()) if lengths.numel() else 0.0,
        "completions/min_length": float(lengths.min()) if lengths.numel() else 0.0,
        "completions/max_length": float(lengths.max()) if lengths.numel() else 0.0,
        "completions/clipped_ratio": float(truncated.double().mean()) if truncated.numel() else 0.0,
        "completions/mean_terminated_length": float(terminated.mean()) if terminated.numel() else 0.0,
    }


def eval_line(step: int, metrics: dict[str, float]) -> str:
    """The console line of an evaluation: reward, each reward's mean (with pass@k and the greedy
    score when it has them), mean completion length, seconds."""
    parts = [f"eval step {step}", f"reward {metrics.get('eval/reward', float('nan')):.3f}"]
    names = [k[len("eval/rewards/"):-len("/mean")] for k in metrics if k.startswith("eval/rewards/") and k.endswith("/mean")]
    for name in names:
        prefix = f"eval/rewards/{name}/"
        stats = [f"{metrics[prefix + 'mean']:.3f}"] + [
            f"{key[len(prefix):]} {value:.3f}" for key, value in metrics.items()
            if key.startswith(prefix + "pass@") or key == prefix + "greedy"
        ]
        parts.append(f"{name} " + " ".join(stats))
    if "eval/completions/mean_length" in metrics:
        parts.append(f"len {metrics['eval/completions/mean_length']:.1f}")
    if "eval/seconds" in metrics:
        parts.append(f"{metrics['eval/seconds']:.1f} s")
    return " | ".join(parts)


def _finite(value: Any) -> float:
    """A float, with NaN (no scored sample at all) reported as 0.0 so no metric is NaN."""
    v = float(value)
    return v if math.isfinite(v) else 0.0


#: Metrics that are states, not per-step amounts: a logging window reports their last value.
LAST_VALUE = ("num_tokens", "learning_rate", "peak_memory_gb")


def average(records: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a logging window: the mean of each key over ``records`` (keys missing from
    some records average the others), the last value of the :data:`LAST_VALUE` keys."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for rec in records:
        for key, value in rec.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    out = {k: sums[k] / counts[k] for k in sums}
    for key in LAST_VALUE:
        for rec in reversed(records):
            if key in rec:
                out[key] = float(rec[key])
                break
    return out


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` in ``output_dir`` (skipping a torn last line)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Keep only the records with ``step <= max_step`` (atomically), so a resumed run continues
    the file of the run it resumes without duplicated or torn lines."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Writes logged steps to the console, ``metrics.jsonl`` and TensorBoard.

    Only the main process should create an enabled writer; a disabled one does nothing.

    Args:
        output_dir: the run's output directory.
        report_to: any of ``"jsonl"``, ``"tensorboard"``.
        total_steps: optimizer steps of the whole run (for the progress display).
        start_step: the step a resumed run starts after.
        enabled: False on non-main processes.
        console: where progress is shown: a :class:`~grpo_plugins.console.RunConsole` (the
            engine's, open for the whole run), True for one of its own, False for none.
        interactive: for a console of its own: whether stdout is a terminal (default: ask it).
    """

    def __init__(
        self,
        output_dir: str | Path,
        report_to: list[str],
        total_steps: int,
        start_step: int = 0,
        *,
        enabled: bool = True,
        console: Any = True,
        interactive: bool | None = None,
    ) -> None:
        from grpo_plugins.console import RunConsole

        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.total_steps = total_steps
        self._jsonl = None
        self._completions = None
        self._tb = None
        self._own_console = console is True and enabled
        if isinstance(console, RunConsole):
            self.console: RunConsole | None = console
        elif self._own_console:
            self.console = RunConsole(interactive=interactive).__enter__()
        else:
            self.console = None
        if self.console is not None:
            self.console.begin(total_steps, start_step)
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.output_dir / COMPLETIONS_FILE, start_step)
        if "jsonl" in report_to:
            truncate_jsonl(self.output_dir / METRICS_FILE, start_step)
            self._jsonl = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed run wrote after its last checkpoint.
            self._tb = SummaryWriter(str(self.output_dir / TENSORBOARD_DIR), purge_step=start_step + 1)

    def progress(self, step: int, metrics: dict[str, float]) -> None:
        """An optimizer step is done: show its rewards, length and time."""
        if self.console is not None:
            self.console.step_done(step, metrics)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one logged step (metrics already averaged over the logging window)."""
        if not self.enabled:
            return
        self._record(step, metrics)
        if self.console is not None:
            self.console.logged(step, metrics)

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        """One record in metrics.jsonl and TensorBoard scalars."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Write an evaluation (``eval/...`` metrics) at ``step``: its own record in metrics.jsonl,
        TensorBoard scalars, and one console line (also above the live bar)."""
        if not self.enabled:
            return
        self._record(step, metrics)
        if self.console is not None:
            self.console.print(eval_line(step, metrics))

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """The compact console line of a logged step (see :meth:`RunConsole.line`)."""
        assert self.console is not None
        return self.console.line(step, metrics)

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append sampled completions (prompt, completion, rewards, advantage) to completions.jsonl."""
        if not self.enabled:
            return
        if self._completions is None:
            self._completions = open(self.output_dir / COMPLETIONS_FILE, "a", encoding="utf-8")
        for rec in records:
            self._completions.write(json.dumps({"step": step, **rec}, default=str) + "\n")
        self._completions.flush()

    def close(self) -> None:
        if self._own_console and self.console is not None:
            self.console.close()
            self.console = None
        for handle in (self._jsonl, self._completions):
            if handle is not None:
                handle.close()
        self._jsonl = self._completions = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
