"""``grpo-plugins report RUN_DIR``: one self-contained HTML page about a run.

The page holds curves of the logged metrics (reward and each reward component with a ± std band,
loss and gradient norm, KL, clip ratios, entropy, completion lengths and the truncated fraction,
step time split into generate / reward / train, learning rate), the run's config, and a table of
sample completions with their rewards at the first, middle and last logged steps. Plots are
inline SVG drawn by matplotlib (Agg backend); the page loads nothing from the network. Metrics a
run did not log (``kl`` with ``beta: 0``, completions without ``log_completions``) get a note
instead of a plot.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.metrics import COMPLETIONS_FILE, METRICS_FILE, read_metrics

REPORT_FILE = "report.html"
#: Completions shown per sampled step.
SAMPLES_PER_STEP = 6
#: Characters of a prompt or completion shown in the table.
MAX_TEXT = 400

#: (section id, heading) in page order; every page has all of them.
SECTIONS = (
    ("summary", "Summary"),
    ("reward", "Reward"),
    ("loss", "Loss and gradient norm"),
    ("kl", "KL to the reference"),
    ("clipping", "Clip ratios"),
    ("entropy", "Entropy"),
    ("lengths", "Completion lengths"),
    ("timing", "Step time"),
    ("learning-rate", "Learning rate"),
    ("config", "Config"),
    ("samples", "Sample completions"),
)


class ReportError(GRPOPluginsError):
    """The run directory cannot be reported on."""


# -- data ------------------------------------------------------------------------------------------


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` over the records that have a finite value for it."""
    steps, values = [], []
    for rec in records:
        value = rec.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in rec:
            steps.append(float(rec["step"]))
            values.append(float(value))
    return steps, values


def _reward_names(records: Sequence[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for rec in records:
        for key in rec:
            match = re.fullmatch(r"rewards/(.+)/mean", key)
            if match:
                names[match.group(1)] = None
    return list(names)


def read_completions(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``completions.jsonl`` (skipping torn lines)."""
    path = run_dir / COMPLETIONS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def sample_steps(steps: Sequence[int]) -> list[int]:
    """The first, middle and last of the distinct ``steps`` (fewer when there are fewer)."""
    distinct = sorted(set(steps))
    if not distinct:
        return []
    return list(dict.fromkeys([distinct[0], distinct[len(distinct) // 2], distinct[-1]]))


# -- plots -----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError(
            "grpo-plugins report draws its plots with matplotlib: pip install 'grpo-plugins[report]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",  # text stays text: small files, searchable
            "font.family": "sans-serif",
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "figure.dpi": 100,
        }
    )
    return plt


def _svg(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog), then closed."""
    plt = _pyplot()
    buffer = io.StringIO()
    fig.tight_layout()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _lines(
    records: Sequence[dict[str, Any]],
    keys: Sequence[tuple[str, str]],
    *,
    band: dict[str, str] | None = None,
    ylabel: str = "",
    logy: bool = False,
    twin: tuple[str, str] | None = None,
) -> str | None:
    """A line plot of ``keys`` ((metric, label) pairs) against the step; ``band`` maps a metric
    to its std metric (a shaded ± band); ``twin`` is (metric, label) on a right-hand axis. None
    when none of the metrics was logged."""
    present = [(k, label) for k, label in keys if _series(records, k)[0]]
    twin_present = twin is not None and bool(_series(records, twin[0])[0])
    if not present and not twin_present:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    for n, (key, label) in enumerate(present):
        steps, values = _series(records, key)
        color = f"C{n}"
        ax.plot(steps, values, label=label, color=color, linewidth=1.4)
        std_key = (band or {}).get(key)
        if std_key:
            by_step = dict(zip(*_series(records, std_key)))
            lo = [v - by_step.get(s, 0.0) for s, v in zip(steps, values)]
            hi = [v + by_step.get(s, 0.0) for s, v in zip(steps, values)]
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15, linewidth=0)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None and twin_present:
        right = ax.twinx()
        steps, values = _series(records, twin[0])
        right.plot(steps, values, color="0.45", linestyle="--", linewidth=1.2, label=twin[1])
        right.set_ylabel(twin[1])
        right.grid(False)
        h2, l2 = right.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles and twin_present:
        # Above the plot: inside it, "best" avoids only the left axis's lines and covers the
        # right axis's line and ticks.
        ax.legend(handles, labels, fontsize=8, frameon=False, loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncol=min(len(handles), 5), borderaxespad=0.2, handlelength=1.5, columnspacing=1.0)
    elif handles:
        ax.legend(handles, labels, fontsize=8, frameon=False, loc="best")
    return _svg(fig)


#: One colour per part of the step-time chart (a distinct one each: none repeats).
TIMING_COLOURS = {"generate": "C0", "reward": "C1", "log-probs": "C2", "train": "C3", "other (overhead)": "0.7"}


def _timing(records: Sequence[dict[str, Any]]) -> str | None:
    """Stacked areas: seconds per step spent generating, scoring, in the old/reference log-prob
    passes, training, and the rest."""
    parts = [
        ("timing/generate", "generate"), ("timing/reward", "reward"), ("timing/logprobs", "log-probs"),
        ("timing/train", "train"),
    ]
    rows = [r for r in records if any(k in r for k, _ in parts) and "step" in r]
    if not rows:
        return None
    plt = _pyplot()
    steps = [float(r["step"]) for r in rows]
    stacks = [[float(r.get(k, 0.0)) for r in rows] for k, _ in parts]
    labels = [label for _, label in parts]
    if any("timing/step" in r for r in rows):
        other = [max(0.0, float(r.get("timing/step", 0.0)) - sum(s[i] for s in stacks)) for i, r in enumerate(rows)]
        stacks.append(other)
        labels.append("other (overhead)")
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.stackplot(steps, stacks, labels=labels, alpha=0.85, colors=[TIMING_COLOURS[label] for label in labels])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    return _svg(fig)


# -- html ------------------------------------------------------------------------------------------

_CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c7cbd4;font-size:13px}
main{padding:16px 32px;display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:16px}
section{background:#fff;border:1px solid #e1e4ea;border-radius:8px;padding:12px 16px}
section.wide{grid-column:1/-1}h2{font-size:16px;margin:4px 0 8px}
svg{width:100%;height:auto}.note{color:#6b7385;font-style:italic}
table{border-collapse:collapse;width:100%;font-size:12px}th,td{border-bottom:1px solid #e1e4ea;padding:4px 6px;
text-align:left;vertical-align:top}th{background:#f0f2f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f0f2f5;padding:8px;border-radius:6px;overflow:auto;font-size:12px;max-height:480px}
.text{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0;font-size:13px}dt{color:#6b7385}
"""


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _prompt_text(prompt: Any) -> str:
    """A prompt as text: a string as is; chat messages as ``role: content`` lines, without the
    system message (the same in every row) when there are others."""
    if isinstance(prompt, list):
        shown = [m for m in prompt if not (isinstance(m, dict) and m.get("role") == "system")] or prompt
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in shown
        )
    return str(prompt)


def _section(section_id: str, body: str, wide: bool = False) -> str:
    heading = dict(SECTIONS)[section_id]
    cls = ' class="wide"' if wide else ""
    return f'<section id="{section_id}"{cls}><h2>{_esc(heading)}</h2>\n{body}\n</section>'


def _plot_or_note(svg: str | None, note: str) -> str:
    return svg if svg is not None else f'<p class="note">{_esc(note)}</p>'


CLIP_KEYS = (
    ("clip_ratio/low_mean", "low (ratio < 1 - ε)"), ("clip_ratio/high_mean", "high (ratio > 1 + ε_high)"),
    ("clip_ratio/region_mean", "either"),
)


def _clip_note(records: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """Why a clip-ratio panel is flat at zero: an on-policy run (one optimizer step per generation
    batch) computes its loss with the policy that sampled, so the ratio is exactly 1."""
    values = [float(r[k]) for r in records for k, _ in CLIP_KEYS if k in r]
    if not values or any(v != 0.0 for v in values):
        return ""
    iterations = int(config.get("num_iterations") or 1)
    accumulation = int(config.get("gradient_accumulation_steps") or 1)
    per_generation = config.get("steps_per_generation") or accumulation
    if iterations == 1 and per_generation == accumulation:
        why = (
            "This run is on-policy (num_iterations 1, one optimizer step per generation batch): each loss "
            "is computed with the weights that sampled the completions, so the importance ratio is exactly 1 "
            "and clips nothing. Clipping acts with num_iterations > 1 or steps_per_generation > "
            "gradient_accumulation_steps."
        )
    else:
        why = "No token's importance ratio left the clip range in this run."
    return f'<p class="note">Every clip ratio is 0. {_esc(why)}</p>'


def _summary(run_dir: Path, records: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    model = config.get("model")
    if isinstance(model, dict):
        model = model.get("name_or_path") or "random initialisation from model.config"
    items: list[tuple[str, str]] = [("run", str(run_dir)), ("model", _fmt(model))]
    if config.get("lora"):
        items.append(("LoRA", f"r={config['lora'].get('r')}, alpha={config['lora'].get('lora_alpha')}"))
    for key in ("loss_type", "task", "beta", "learning_rate", "num_generations", "max_steps"):
        if key in config:
            value = config[key]
            items.append((key, _fmt(value.get("name") if isinstance(value, dict) else value)))
    if records:
        items.append(("logged steps", f"{len(records)} (last step {records[-1].get('step')})"))
        steps, rewards = _series(records, "reward")
        if rewards:
            k = max(1, min(5, len(rewards) // 4))
            first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
            items.append(("reward", f"{first:.3f} → {last:.3f} (mean of the first and last {k} logged steps)"))
        _, seconds = _series(records, "timing/step")
        if seconds:
            items.append(("time in logged steps", f"{sum(seconds):.0f} s ({sum(seconds) / len(seconds):.2f} s/step)"))
    else:
        items.append(("logged steps", "none yet"))
    rows = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in items)
    return f"<dl>{rows}</dl>"


def _samples_table(completions: Sequence[dict[str, Any]]) -> str:
    if not completions:
        return '<p class="note">No completions logged (set log_completions: true to record them).</p>'
    chosen = sample_steps([int(r["step"]) for r in completions])
    names: dict[str, None] = {}
    for rec in completions:
        for name in (rec.get("rewards") or {}):
            names[name] = None
    head = "".join(f"<th>{_esc(h)}</th>" for h in ["step", "prompt", "completion", *names, "advantage"])
    body = []
    for step in chosen:
        rows = [r for r in completions if int(r["step"]) == step][:SAMPLES_PER_STEP]
        for rec in rows:
            rewards = rec.get("rewards") or {}
            cells = [
                f'<td class="num">{step}</td>',
                f'<td class="text">{_esc(_clip(_prompt_text(rec.get("prompt", ""))))}</td>',
                f'<td class="text">{_esc(_clip(str(rec.get("completion", ""))))}</td>',
                *(f'<td class="num">{_esc(_fmt(rewards.get(n)))}</td>' for n in names),
                f'<td class="num">{_esc(_fmt(rec.get("advantage")))}</td>',
            ]
            body.append("<tr>" + "".join(cells) + "</tr>")
    which = ", ".join(str(s) for s in chosen)
    return (
        f"<p>Up to {SAMPLES_PER_STEP} logged completions at steps {which} (first, middle, last); "
        "system messages are left out.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def render_report(run_dir: str | os.PathLike[str]) -> str:
    """The HTML page for the run in ``run_dir``."""
    import yaml

    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ReportError(f"'{run_dir}' is not a directory; give a run's output directory")
    config_path = run_dir / "config.yaml"
    if not (run_dir / METRICS_FILE).is_file() and not config_path.is_file():
        raise ReportError(
            f"'{run_dir}' has neither {METRICS_FILE} nor config.yaml; give a run's output directory "
            "(output_dir of its config)"
        )
    records = sorted(read_metrics(run_dir), key=lambda r: r.get("step", 0))
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else ""
    try:
        config = yaml.safe_load(config_text) or {} if config_text else {}
    except yaml.YAMLError:
        config = {}
    config = config if isinstance(config, dict) else {}
    completions = read_completions(run_dir)
    names = _reward_names(records)

    reward_keys = [("reward", "reward (weighted)")] + [(f"rewards/{n}/mean", n) for n in names]
    bands = {"reward": "reward_std", **{f"rewards/{n}/mean": f"rewards/{n}/std" for n in names}}
    no_kl = "Not logged: beta is 0, so no reference model and no KL." if config.get("beta", 0.0) in (0, 0.0) else "Not logged."
    sections = [
        _section("summary", _summary(run_dir, records, config), wide=True),
        _section("reward", _plot_or_note(
            _lines(records, reward_keys, band=bands, ylabel="reward"),
            "No rewards logged.") + '<p class="note">Bands: ± std (of the group rewards for the weighted '
            "reward, of the samples for each component).</p>"),
        _section("loss", _plot_or_note(
            _lines(records, [("loss", "loss")], ylabel="loss", twin=("grad_norm", "grad norm")), "No loss logged.")),
        _section("kl", _plot_or_note(_lines(records, [("kl", "kl")], ylabel="KL"), no_kl)),
        _section("clipping", _plot_or_note(_lines(records, CLIP_KEYS, ylabel="fraction of tokens"),
                                           "No clip ratios logged.") + _clip_note(records, config)),
        _section("entropy", _plot_or_note(_lines(records, [("entropy", "entropy")], ylabel="nats / token"),
                                          "No entropy logged.")),
        _section("lengths", _plot_or_note(_lines(records, [
            ("completions/mean_length", "mean"), ("completions/min_length", "min"),
            ("completions/max_length", "max"), ("completions/mean_terminated_length", "mean of terminated")],
            ylabel="tokens", twin=("completions/clipped_ratio", "truncated fraction")),
            "No completion lengths logged.")),
        _section("timing", _plot_or_note(_timing(records), "No step timing logged.")),
        _section("learning-rate", _plot_or_note(
            _lines(records, [("learning_rate", "learning rate")], ylabel="learning rate"),
            "No learning rate logged.")),
        _section("config", f"<pre>{_esc(config_text)}</pre>" if config_text else
                 '<p class="note">No config.yaml in the run directory.</p>', wide=True),
        _section("samples", _samples_table(completions), wide=True),
    ]
    title = f"GRPO run report: {run_dir.name}"
    subtitle = f"{len(records)} logged steps · {_esc(run_dir.resolve())} · written by grpo-plugins report"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{_esc(title)}</title>"
        f"<style>{_CSS}</style></head>\n<body><header><h1>{_esc(title)}</h1><p>{subtitle}</p></header>\n<main>\n"
        + "\n".join(sections)
        + "\n</main></body></html>\n"
    )


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``), atomically."""
    page = render_report(run_dir)
    target = Path(out).expanduser() if out is not None else Path(run_dir).expanduser() / REPORT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    return target
