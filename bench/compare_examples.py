"""Learning curves of several settings over several seeds, side by side: reads the
``example-<setting>-s<seed>.json`` summaries that ``bench/run_example.py --name <setting>-s<seed>``
writes and prints, per setting and window of steps, the mean over seeds of each reward and its
spread (smallest and largest seed).

    python bench/compare_examples.py outputs/bench/fp8-learning [--key rewards/correct_answer/mean]

Two settings learn alike when each window's means lie within the other's seed spread.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_NAME = re.compile(r"example-(?P<setting>.+)-s(?P<seed>\d+)\.json$")


def load_runs(folder: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """setting -> seed -> summary, from every ``example-<setting>-s<seed>.json`` under ``folder``."""
    runs: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for path in sorted(folder.rglob("example-*-s*.json")):
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


if __name__ == "__main__":
    main()
