"""Learning curves of several settings over several seeds, side by side: reads the
``example-<setting>-s<seed>.json`` summaries that ``bench/run_example.py --name <setting>-s<seed>``
writes and prints, per setting and window of steps, the mean over seeds of each reward and its
spread (smallest and largest seed).

    python bench/compare_examples.py outputs/bench/fp8-learning [--key rewards/correct_answer/mean]

Two settings learn alike when each window's means lie within the other's seed spread. Where a run
folder also holds ``eval-<setting>-s<seed>.json`` (``grpo-plugins eval --json`` of its last
checkpoint), the held-out scores follow: the trained policies themselves, whatever sampled their
training rollouts.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_NAME = re.compile(r"(example|eval)-(?P<setting>.+)-s(?P<seed>\d+)\.json$")


def load_runs(folder: Path, kind: str = "example") -> dict[str, dict[int, dict[str, Any]]]:
    """setting -> seed -> summary, from every ``<kind>-<setting>-s<seed>.json`` under ``folder``
    (``kind``: ``example`` for run_example.py's summaries, ``eval`` for evaluations)."""
    runs: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for path in sorted(folder.rglob(f"{kind}-*-s*.json")):
        match = _NAME.search(path.name)
        if match:
            runs[match["setting"]][int(match["seed"])] = json.loads(path.read_text())
    return dict(runs)


def curves(runs: dict[int, dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per window of steps: ``first``, ``last``, ``mean`` over seeds, ``low`` and ``high`` seed
    values, and ``seeds`` (how many runs reached that window)."""
    field = "reward_windows" if key == "reward" else f"{key}_windows"
    per_window: dict[tuple[int, int], list[float]] = defaultdict(list)
    for summary in runs.values():
        for first, last, value in summary.get(field, []):
            per_window[(first, last)].append(value)
    return [
        {"first": first, "last": last, "mean": sum(v) / len(v), "low": min(v), "high": max(v), "seeds": len(v)}
        for (first, last), v in sorted(per_window.items())
    ]


def table(all_runs: dict[str, dict[int, dict[str, Any]]], key: str) -> str:
    lines = [f"{key}: mean over seeds [lowest, highest seed]"]
    for setting, runs in sorted(all_runs.items()):
        cells = [f"{w['first']}-{w['last']}: {w['mean']:.3f} [{w['low']:.3f}, {w['high']:.3f}]" for w in curves(runs, key)]
        lines.append(f"  {setting} (seeds {sorted(runs)}): " + "  ".join(cells))
    return "\n".join(lines)


def held_out(evals: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Per setting, the mean over seeds [lowest, highest seed] of the evaluations' weighted reward
    (sampled and greedy) and of each reward's mean and greedy score."""

    def cell(values: list[float]) -> str:
        return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"

    lines = ["held-out evaluation of the last checkpoint: mean over seeds [lowest, highest seed]"]
    for setting, runs in sorted(evals.items()):
        parts = []
        for label, key in (("reward", "reward"), ("greedy", "greedy_reward")):
            values = [r[key] for r in runs.values() if r.get(key) is not None]
            if values:
                parts.append(f"{label} {cell(values)}")
        names = [r["name"] for r in next(iter(runs.values())).get("rewards", [])]
        for name in names:
            for field in ("mean", "greedy"):
                values = [x[field] for r in runs.values() for x in r.get("rewards", []) if x["name"] == name and x.get(field) is not None]
                if values:
                    parts.append(f"{name} {field} {cell(values)}")
        lines.append(f"  {setting} (seeds {sorted(runs)}): " + "  ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--key", action="append", help="reward (default) or a metric such as rewards/correct_answer/mean")
    args = parser.parse_args()
    runs = load_runs(args.folder)
    if not runs:
        raise SystemExit(f"no example-<setting>-s<seed>.json under {args.folder}")
    for key in args.key or ["reward", "rewards/correct_answer/mean"]:
        print(table(runs, key), flush=True)
    evals = load_runs(args.folder, "eval")
    if evals:
        print(held_out(evals), flush=True)


if __name__ == "__main__":
    main()
