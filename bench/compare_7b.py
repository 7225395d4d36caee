"""The long-completion memory comparison from one folder (``bash bench/gpu_suite.sh long`` writes
it): this project's ``mem7b_<variant>.json`` (``profile_memory.py``)
against Unsloth's ``unsloth_7b*.json`` (``bench_unsloth.py``), or, for an Unsloth run stopped
before its end, its ``*.progress.jsonl`` (the allocator's counters every 10 s: a lower bound of
its peak). Process peaks come from ``nvidia_smi_apps.log`` (``pid, used_memory`` every 10 s),
matched by the pid each script records.

    python bench/compare_7b.py outputs/bench/DATE-COMMIT/long

Prints one Markdown table; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

GIB_PER_MIB = 1 / 1024


def process_peaks(log: Path) -> dict[int, float]:
    """Largest ``used_memory`` (GiB) seen per pid in nvidia-smi's per-process log."""
    peaks: dict[int, float] = {}
    if not log.exists():
        return peaks
    for line in log.read_text().splitlines():
        for pid, mib in re.findall(r"(\d+), (\d+) MiB", line):
            peaks[int(pid)] = max(peaks.get(int(pid), 0.0), int(mib) * GIB_PER_MIB)
    return peaks


def ours(path: Path, peaks: dict[int, float]) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    rows = []
    for name, run in data["runs"].items():
        rows.append({
            "run": f"ours {name}", "finished": True,
            "allocated_gib": run["peak_gib"], "reserved_gib": run["reserved_peak_gib"],
            "process_gib": peaks.get(data.get("pid", -1)), "step_s": run["step_s"],
        })
    return rows


def unsloth(folder: Path, stem: str, peaks: dict[int, float]) -> dict[str, Any] | None:
    done, progress = folder / f"{stem}.json", folder / f"{stem}.progress.jsonl"
    name = "Unsloth " + ("QLoRA" if stem.endswith("4bit") else "LoRA")
    if done.exists():
        data = json.loads(done.read_text())
        return {
            "run": name, "finished": True, "allocated_gib": data["peak_gib"], "reserved_gib": None,
            "process_gib": peaks.get(data.get("pid", -1)), "step_s": data["step_s"],
        }
    if not progress.exists():
        return None
    rows = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    last = rows[-1]
    return {
        "run": name, "finished": False, "allocated_gib": max(r["peak_allocated_gib"] for r in rows),
        "reserved_gib": max(r["peak_reserved_gib"] for r in rows), "process_gib": peaks.get(last.get("pid", -1)),
        "step_s": None, "stopped_after_s": last["elapsed_s"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    def gib(x: float | None, bound: bool) -> str:
        return "-" if x is None else f"{'≥ ' if bound else ''}{x:.2f}"

    lines = ["| run | peak allocated (GiB) | peak reserved (GiB) | process peak (GiB) | step (s) |", "|---|---|---|---|---|"]
    for r in rows:
        bound = not r["finished"]
        step = f"{r['step_s']:.1f}" if r["step_s"] is not None else f"stopped after {r.get('stopped_after_s', 0):.0f} s"
        lines.append(
            f"| {r['run']} | {gib(r['allocated_gib'], bound)} | {gib(r['reserved_gib'], bound)} | "
            f"{gib(r['process_gib'], bound)} | {step} |"
        )
    return "\n".join(lines)


def compare(folder: Path) -> list[dict[str, Any]]:
    peaks = process_peaks(folder / "nvidia_smi_apps.log")
    rows = [row for path in sorted(folder.glob("mem7b_*.json")) for row in ours(path, peaks)]
    for stem in ("unsloth_7b", "unsloth_7b_4bit"):
        row = unsloth(folder, stem, peaks)
        if row is not None:
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = compare(args.folder)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
