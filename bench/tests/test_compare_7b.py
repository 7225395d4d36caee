"""bench/compare_7b.py: the 7B memory table from one folder of results, with an Unsloth run that was
stopped early reported as a lower bound from its progress log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def compare_7b(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.compare_7b as module

    return module


def test_ours_finished_unsloth_and_stopped_unsloth(compare_7b, tmp_path: Path) -> None:
    (tmp_path / "mem7b_long-lean.json").write_text(json.dumps({
        "pid": 11, "runs": {"long-lean": {"peak_gib": 22.1, "reserved_peak_gib": 22.5, "step_s": 300.0}},
    }))
    (tmp_path / "unsloth_7b.json").write_text(json.dumps({"pid": 12, "peak_gib": 30.0, "step_s": 900.0}))
    progress = [
        {"pid": 13, "elapsed_s": 10.0, "peak_allocated_gib": 6.0, "peak_reserved_gib": 6.5},
        {"pid": 13, "elapsed_s": 20.0, "peak_allocated_gib": 14.5, "peak_reserved_gib": 15.0},
    ]
    (tmp_path / "unsloth_7b_4bit.progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in progress))
    (tmp_path / "nvidia_smi_apps.log").write_text(
        "00:00:01 11, 20000 MiB 12, 25000 MiB 13, 9000 MiB \n00:00:11 11, 23552 MiB 13, 16384 MiB \n00:00:21 \n"
    )
    rows = {r["run"]: r for r in compare_7b.compare(tmp_path)}
    assert rows["ours long-lean"]["process_gib"] == 23.0 and rows["ours long-lean"]["allocated_gib"] == 22.1
    assert rows["Unsloth LoRA"]["finished"] and rows["Unsloth LoRA"]["process_gib"] == 25000 / 1024
    stopped = rows["Unsloth QLoRA"]
    assert not stopped["finished"] and stopped["allocated_gib"] == 14.5 and stopped["process_gib"] == 16.0
    text = compare_7b.table(list(rows.values()))
    assert "| Unsloth QLoRA | ≥ 14.50 | ≥ 15.00 | ≥ 16.00 | stopped after 20 s |" in text
    assert "| ours long-lean | 22.10 | 22.50 | 23.00 | 300.0 |" in text
