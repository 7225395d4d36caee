"""``grpo-plugins report``: one self-contained HTML page, rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from grpo_plugins.cli import main
from grpo_plugins.report import SECTIONS, render_report, sample_steps

STEPS = 10
#: Sections drawn as a plot for the run below (it logs no ``kl``: beta is 0).
PLOTTED = ["reward", "loss", "clipping", "entropy", "lengths", "timing", "learning-rate"]


def _record(step: int) -> dict[str, float]:
    return {
        "step": step,
        "reward": step / 10,
        "reward_std": 0.1,
        "rewards/correct_answer/mean": step / 20,
        "rewards/correct_answer/std": 0.2,
        "rewards/format/mean": 0.5,
        "rewards/format/std": 0.0,
        "loss": 0.1 / step,
        "grad_norm": 1.0,
        "entropy": 2.0 - step / 10,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.01,
        "clip_ratio/region_mean": 0.01,
        "completions/mean_length": 30.0 + step,
        "completions/min_length": 5.0,
        "completions/max_length": 64.0,
        "completions/mean_terminated_length": 25.0,
        "completions/clipped_ratio": 0.25,
        "timing/generate": 1.0,
        "timing/reward": 0.25,
        "timing/train": 0.5,
        "timing/step": 2.0,
        "learning_rate": 1e-4,
    }


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(_record(s)) + "\n" for s in range(1, STEPS + 1)))
    (run / "config.yaml").write_text("model: builtin:smollm2-135m-instruct\nloss_type: dapo\nbeta: 0.0\nmax_steps: 10\n")
    completions = [
        {
            "step": step,
            "prompt": [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": f"What is {step} + {n}?"}],
            "completion": f"<answer>{step + n}</answer> <b>bold</b>",
            "rewards": {"correct_answer": 1.0, "format": None},
            "advantage": 0.5,
        }
        for step in range(1, STEPS + 1)
        for n in range(8)
    ]
    (run / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    return run


def test_sample_steps_are_the_first_middle_and_last() -> None:
    assert sample_steps(list(range(1, 11))) == [1, 6, 10]
    assert sample_steps([4, 4, 2, 9]) == [2, 4, 9]
    assert sample_steps([3, 3]) == [3]
    assert sample_steps([]) == []


def test_report_has_every_section_and_plots_what_was_logged(run_dir: Path) -> None:
    page = render_report(run_dir)
    for section_id, heading in SECTIONS:
        assert f'<section id="{section_id}"' in page and heading in page
    plotted = [sid for sid in re.findall(r'<section id="([^"]+)"[^>]*>(?:(?!</section>).)*?<svg', page, re.S)]
    assert plotted == PLOTTED
    assert "Not logged: beta is 0" in page  # kl
    assert "0.150 → 0.950" in page  # mean reward of the first and last 2 logged steps
    assert "20 s (2.00 s/step)" in page
    # Completions of steps 1, 6 and 10 only, 6 of each, escaped.
    steps = [int(s) for s in re.findall(r'<tr><td class="num">(\d+)</td>', page)]
    assert steps == [1] * 6 + [6] * 6 + [10] * 6
    assert "user: What is 6 + 5?" in page and "Answer in tags." not in page and "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page
    # Nothing is fetched when the page is viewed: no external scripts, styles, images or fonts.
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page) and "@import" not in page


def _section_of(page: str, section_id: str) -> str:
    return re.search(rf'<section id="{section_id}".*?</section>', page, re.S).group(0)


def test_step_time_parts_each_have_their_own_colour(run_dir: Path) -> None:
    timing = _section_of(render_report(run_dir), "timing")
    fills = re.findall(r'<g id="\w*PolyCollection_\d+">\s*<path[^>]*style="fill: ([^;"]+)', timing)
    # generate, reward, log-probs, train, other (overhead)
    assert len(fills) == 5 and len(set(fills)) == 5, fills


def test_completion_length_legend_sits_above_the_plot(run_dir: Path) -> None:
    """With a right-hand axis (the truncated fraction) the legend would cover lines or that axis."""
    lengths = _section_of(render_report(run_dir), "lengths")
    top = float(re.search(r'<g id="patch_2">\s*<path d="M [\d.]+ [\d.]+\s*L [\d.]+ [\d.]+\s*L [\d.]+ ([\d.]+)', lengths).group(1))
    legend = lengths[lengths.index('id="legend_1"'):]
    ys = [float(y) for y, label in re.findall(r'<text[^>]*y="([\d.]+)"[^>]*>([^<]*)<', legend)
          if label in ("mean", "min", "max", "mean of terminated", "truncated fraction")][:5]  # then the axis label
    assert len(ys) == 5 and max(ys) < top, (ys, top)


def test_clip_panel_says_why_an_on_policy_run_clips_nothing(run_dir: Path) -> None:
    records = [_record(s) | {"clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0} for s in range(1, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    clipping = _section_of(render_report(run_dir), "clipping")
    assert "Every clip ratio is 0. This run is on-policy (num_iterations 1" in clipping
    # Off-policy steps (two passes over each batch) that clipped nothing get the plain fact.
    (run_dir / "config.yaml").write_text("num_iterations: 2\n")
    clipping = _section_of(render_report(run_dir), "clipping")
    assert "Every clip ratio is 0. No token&#x27;s importance ratio left the clip range" in clipping
    # A run that clipped something gets no note.
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_record(s)) + "\n" for s in range(1, 4)))
    assert "Every clip ratio is 0" not in _section_of(render_report(run_dir), "clipping")


def test_report_of_a_run_without_metrics_or_completions_notes_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("model: x\nbeta: 0.04\n")
    page = render_report(tmp_path)
    assert all(f'<section id="{sid}"' in page for sid, _ in SECTIONS)
    assert "<svg" not in page
    assert "No rewards logged." in page and "No completions logged" in page and "logged steps</dt><dd>none yet" in page


@pytest.mark.parametrize(
    ("make", "message"),
    [(lambda p: p / "missing", "is not a directory"), (lambda p: p, "neither metrics.jsonl nor config.yaml")],
)
def test_report_mistakes_get_one_clear_message(make, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _chromium() -> str:
    """The Chromium binary; a missing one skips the test, except in CI (scripts/setup.sh installs it)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("CI must render the report in Chromium, but no chromium is installed (scripts/setup.sh)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


@pytest.mark.slow
def test_report_renders_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    from PIL import Image, ImageStat

    chromium = _chromium()
    out = tmp_path / "page" / "report.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2400"]
    url = out.resolve().as_uri()
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], check=True, capture_output=True, timeout=120)
    dom = subprocess.run([*flags, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120).stdout

    # Chromium parsed every section and drew the plots inline.
    assert all(f'id="{sid}"' in dom for sid, _ in SECTIONS)
    assert dom.count("<svg") == len(PLOTTED)
    # The screenshot is not blank: many colours, and a good share of the page is not background.
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2400)
    colours = image.getcolors(maxcolors=1 << 20) or []
    background = max(colours)[1]
    covered = 1 - max(colours)[0] / (image.size[0] * image.size[1])
    print("chromium screenshot:", len(colours), "colours,", round(covered, 3), "not background")
    assert len(colours) > 200 and covered > 0.1, (len(colours), covered, background)
    assert max(ImageStat.Stat(image).stddev) > 20
