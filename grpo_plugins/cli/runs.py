"""``grpo-plugins train``, ``eval``, ``export`` and ``report``: the commands that run a model or
read a run's output."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grpo_plugins.cli.output import EXIT_INTERRUPTED, _console, _print_json, _show_info_logs


def cmd_train(args: argparse.Namespace) -> int:
    import time

    from grpo_plugins.validation import validate_config

    config = validate_config(args.config, overrides=args.set)
    _show_info_logs()
    from grpo_plugins.engine import run_training

    started = time.monotonic()
    try:
        result = run_training(config, resume=args.resume)
    except KeyboardInterrupt as stop:
        if args.debug:
            raise
        _print_interrupted(args, config.output_dir, stop)
        return EXIT_INTERRUPTED
    output_dir = getattr(result, "output_dir", None)
    if output_dir is not None:
        _print_run_summary(args, result, time.monotonic() - started)
    return 0


def _train_command(args: argparse.Namespace, *extra: str) -> str:
    """The ``grpo-plugins train`` command line of this run, plus ``extra``."""
    import shlex

    sets = [f"--set {shlex.quote(item)}" for item in args.set]
    return " ".join(["grpo-plugins train", shlex.quote(args.config), *sets, *extra])


def _print_interrupted(args: argparse.Namespace, output_dir: str, stop: KeyboardInterrupt) -> None:
    """Where a Ctrl-C left the run and the command that continues it."""
    from grpo_plugins.checkpoint import latest_checkpoint

    console = _console(stderr=True)
    step = getattr(stop, "step", None)
    checkpoint = getattr(stop, "checkpoint", None) or latest_checkpoint(output_dir)
    at = f" at step {step}" if step is not None else ""
    if checkpoint is None:
        console.print(
            f"[yellow]interrupted{at}; no checkpoint was saved yet. Start again with the same command "
            f"(if it says output_dir holds an earlier run, delete '{output_dir}' or add --set output_dir=...)[/yellow]",
            soft_wrap=True,
        )
        return
    saved = "saved" if getattr(stop, "saved_now", False) else "the last checkpoint is"
    lost = ""
    saved_step = _checkpoint_step(checkpoint)
    if step is not None and saved_step is not None and saved_step < step:
        lost = f"; steps {saved_step + 1}-{step} are not in it and will be trained again"
    console.print(f"[yellow]interrupted{at}: {saved} {checkpoint}{lost}[/yellow]", soft_wrap=True)
    console.print(f"continue with: {_train_command(args, '--resume')}", soft_wrap=True, highlight=False)


def _checkpoint_step(checkpoint: Path) -> int | None:
    name = Path(checkpoint).name
    return int(name.rpartition("-")[2]) if name.rpartition("-")[2].isdigit() else None


def _print_run_summary(args: argparse.Namespace, result: Any, seconds: float) -> None:
    """The end of a run: first against last quarter of each reward and the completion length,
    the wall time, where everything is, and the commands that come next."""
    import shlex

    from rich.markup import escape
    from rich.table import Table

    from grpo_plugins.console import clock, first_and_last
    from grpo_plugins.metrics import METRICS_FILE, read_metrics

    output_dir = Path(result.output_dir)
    records = [r for r in read_metrics(output_dir) if "reward" in r] or list(getattr(result, "history", []) or [])
    console = _console()
    steps = getattr(result, "global_step", None)
    done = f"{steps} steps" if steps is not None else "training"
    console.print(f"[green]done: {done} in {clock(seconds)}[/green]", soft_wrap=True)
    if records:
        n = max(1, len(records) // 4)
        first = f"steps {records[0].get('step', '?')}-{records[n - 1].get('step', '?')}"
        last = f"steps {records[-n].get('step', '?')}-{records[-1].get('step', '?')}"
        table = Table(box=None, pad_edge=False, show_edge=False)
        table.add_column("")
        table.add_column(f"first quarter ({first})", justify="right")
        table.add_column(f"last quarter ({last})", justify="right")
        names = [k[len("rewards/"):-len("/mean")] for k in records[-1] if k.startswith("rewards/") and k.endswith("/mean")]
        rows = [("reward (weighted)", "reward", 3)] + [(name, f"rewards/{name}/mean", 3) for name in names]
        rows.append(("completion length", "completions/mean_length", 1))
        for label, key, digits in rows:
            pair = first_and_last(records, key)
            if pair is not None:
                table.add_row(escape(label), f"{pair[0]:.{digits}f}", f"{pair[1]:.{digits}f}")
        console.print(table)
    run = shlex.quote(str(output_dir))
    checkpoint = getattr(result, "checkpoint", None)
    if checkpoint is not None:
        console.print(f"checkpoint: {escape(str(checkpoint))}", soft_wrap=True)
    console.print(f"metrics: {escape(str(output_dir / METRICS_FILE))}", soft_wrap=True)
    console.print("next:", soft_wrap=True)
    for command, what in (
        (" ".join(["grpo-plugins eval", shlex.quote(args.config), *(f"--set {shlex.quote(i)}" for i in args.set)]),
         "held-out reward of the newest checkpoint"),
        (f"grpo-plugins report {run}", "an HTML page with the run's curves and samples"),
        (f"grpo-plugins export {run} --out {shlex.quote(str(output_dir / 'exported'))}",
         "a transformers checkpoint (a LoRA adapter merged in); --gguf FILE for llama.cpp"),
    ):
        console.print(f"  {escape(command)}    [dim]{what}[/dim]", soft_wrap=True)


def cmd_eval(args: argparse.Namespace) -> int:
    from grpo_plugins.config import ConfigError
    from grpo_plugins.validation import eval_prompts_problem, validate_config

    config = validate_config(args.config, overrides=args.set)
    problem = eval_prompts_problem(config)
    if problem is not None:
        raise ConfigError([problem], args.config)
    _show_info_logs()
    from grpo_plugins.evaluation import evaluate

    with _eval_progress() as progress:
        result = evaluate(config, checkpoint=args.checkpoint, base=args.base, progress=progress)
    if args.json:
        _print_json(result.to_json())
        return 0
    _print_eval(result)
    return 0


@contextlib.contextmanager
def _eval_progress() -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr for the generate calls of ``eval`` (terminals only)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=_console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task("eval", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _print_eval(result: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    ks = sorted({k for r in result.rewards for k in r.pass_at})
    console = _console()
    console.print(
        f"[bold]eval of {escape(result.model)}[/bold]: {result.num_prompts} prompts x {result.num_generations} "
        f"samples + 1 greedy each ({result.seconds:.1f} s)",
        soft_wrap=True,
    )
    table = Table()
    for column in ("reward", "weight", "mean", *(f"pass@{k}" for k in ks), "greedy"):
        table.add_column(column, justify="left" if column == "reward" else "right")
    for r in result.rewards:
        table.add_row(
            escape(r.name), f"{r.weight:g}", cell(r.mean), *(cell(r.pass_at.get(k)) for k in ks), cell(r.greedy)
        )
    table.add_row("[bold]weighted[/bold]", "", cell(result.reward), *("" for _ in ks), cell(result.greedy_reward))
    console.print(table)
    console.print(
        f"mean completion length {result.mean_length:.1f} tokens ({result.clipped_ratio:.0%} cut at "
        f"max_completion_length); greedy {result.greedy_mean_length:.1f}. pass@k: rewards that scored only 0 and 1."
    )


def cmd_export(args: argparse.Namespace) -> int:
    from grpo_plugins.export import export

    _show_info_logs()
    result = export(
        args.source, args.out, gguf=args.gguf, gguf_type=args.gguf_type, dtype=args.dtype, overwrite=args.overwrite
    )
    console = _console()
    merged = "LoRA adapter merged" if result.merged_lora else "full weights"
    console.print(f"exported {result.checkpoint} ({merged})", soft_wrap=True)
    if result.out is not None:
        console.print(f"[green]transformers checkpoint ({result.dtype}): {result.out}[/green]", soft_wrap=True)
    if result.gguf is not None:
        console.print(f"[green]GGUF ({args.gguf_type}): {result.gguf}[/green]", soft_wrap=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from grpo_plugins.report import write_report

    path = write_report(args.run_dir, args.out)
    _console().print(f"[green]report: {path}[/green]", soft_wrap=True)
    return 0
