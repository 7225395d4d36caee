"""The ``grpo-plugins`` command line: list/show plugins, validate and plan configs, train, evaluate.

Every user mistake (a :class:`~grpo_plugins.errors.GRPOPluginsError`, a bad YAML file) is
printed as one red message on stderr with exit status 2, never a traceback (``--debug`` shows
it). Ctrl-C exits with 130. Heavy modules are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import sys
import tempfile
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.files import as_ordinary

if TYPE_CHECKING:
    from pydantic import BaseModel
    from rich.console import Console

    from grpo_plugins.batching import BatchPlan
    from grpo_plugins.registry import Component, Registry

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: Batch settings that ``plan`` takes as flags (``--per-device-train-batch-size 3``).
PLAN_FLAGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_processes",
    "num_iterations",
)


# -- output helpers ------------------------------------------------------------------------------


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a test): wide enough that tables do not fold names and versions.
    width = None if stream.isatty() else max(160, int(os.environ.get("COLUMNS", "0") or 0))
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def _error(message: str) -> None:
    from rich.text import Text

    _console(stderr=True).print(Text(f"error: {message}", style="bold red"), soft_wrap=True)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    from rich.text import Text

    _console(stderr=True).print(Text(f"warning: {message}", style="yellow"), soft_wrap=True)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _plan_json(data: dict[str, Any]) -> str:
    """The plan's JSON with one line per step (valid JSON, readable in a terminal)."""
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "cycles")
    cycles = ",\n".join(
        '  {"steps": [\n' + ",\n".join(f"    {json.dumps(step)}" for step in cycle["steps"]) + "\n  ]}"
        for cycle in data["cycles"]
    )
    return "{" + head + ', "cycles": [\n' + cycles + "\n]}\n"


def type_label(annotation: Any) -> str:
    """A readable type for docs and tables: ``int | None``, ``"token" | "sequence"``, ``ModelSpec``."""
    from pydantic import BaseModel

    if annotation is type(None) or annotation is None:
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_label(a) for a in args)
    if origin in (list, Sequence):
        return f"list[{type_label(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if origin is typing.Annotated:
        return type_label(args[0])
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: Any) -> str:
    """``> 0``, ``>= 1, <= 1`` from a field's annotated-types metadata."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = [
        f"{symbols[attr]} {getattr(m, attr)}"
        for m in field.metadata
        for attr in symbols
        if getattr(m, attr, None) is not None
    ]
    return ", ".join(parts)


def _default_label(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return json.dumps(value) if not isinstance(value, str) else value


def params_rows(model: type[BaseModel] | None) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) for each field of a params model."""
    if model is None:
        return []
    return [
        (name, " ".join(filter(None, [type_label(f.annotation), _constraints(f)])), _default_label(f), f.description or "")
        for name, f in model.model_fields.items()
    ]


def _params_summary(component: Component) -> str:
    rows = params_rows(component.params_model)
    return ", ".join(f"{n}: {t} = {d}" for n, t, d, _ in rows) if rows else "-"


# -- list / show ---------------------------------------------------------------------------------


def _registry() -> Registry:
    from grpo_plugins.registry import get_registry

    return get_registry()


def cmd_list(args: argparse.Namespace) -> int:
    registry = _registry()
    components = registry.components(args.kind)
    duplicates = [d for d in registry.duplicates() if args.kind in (None, d[0].kind)]
    dup_keys = {(d[0].kind, d[0].name) for d in duplicates}
    if args.json:
        _print_json(
            {
                "components": [
                    {
                        "kind": c.kind,
                        "name": c.name,
                        "qualified_name": c.qualified_name,
                        "distribution": c.distribution,
                        "version": c.version,
                        "plugin": c.plugin,
                        "doc": c.doc,
                        "params_schema": c.params_schema(),
                        "duplicate": (c.kind, c.name) in dup_keys,
                    }
                    for c in components
                ],
                "broken": [
                    {"plugin": b.plugin, "distribution": b.distribution, "version": b.version, "error": b.error}
                    for b in registry.broken
                ],
                "duplicates": [
                    {"kind": d[0].kind, "name": d[0].name, "distributions": [c.distribution for c in d]}
                    for d in duplicates
                ],
            }
        )
        return 0
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    if not components:
        console.print("No components registered.")
    for kind in dict.fromkeys(c.kind for c in components):
        table = Table(title=f"{kind}", title_justify="left", title_style="bold")
        for column in ("name", "distribution", "version", "description", "params"):
            table.add_column(column, no_wrap=column in ("name", "distribution", "version"), ratio=None)
        for c in (c for c in components if c.kind == kind):
            name = escape(c.name) + (" [red](duplicate)[/red]" if (c.kind, c.name) in dup_keys else "")
            table.add_row(name, escape(c.distribution), c.version or "-", escape(c.doc), escape(_params_summary(c)))
        console.print(table)
    for d in duplicates:
        which = " and ".join(f"{c.distribution} {c.version or ''}".strip() for c in d)
        choose = " or ".join(f"'{c.qualified_name}'" for c in d)
        console.print(
            f"[red]duplicate {d[0].kind} '{d[0].name}': registered by {which}; name it as {choose}[/red]"
        )
    if registry.broken:
        broken = Table(title="broken plugins (not loaded)", title_justify="left", title_style="red")
        for column in ("plugin", "distribution", "version", "error"):
            broken.add_column(column, no_wrap=column != "error")
        for b in registry.broken:
            broken.add_row(b.plugin, b.distribution, b.version or "-", b.error)
        console.print(broken)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import difflib

    from grpo_plugins.registry import UnknownComponentError

    registry = _registry()
    found = registry.find(args.name, args.kind)
    if not found:
        names = sorted({c.name for c in registry.components(args.kind)})
        close = difflib.get_close_matches(args.name.rpartition(":")[2], names, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        kind = args.kind or "component"
        raise UnknownComponentError(f"no {kind} named '{args.name}'{hint} (see grpo-plugins list)")
    if args.json:
        _print_json(
            [
                {
                    "kind": c.kind,
                    "name": c.name,
                    "distribution": c.distribution,
                    "version": c.version,
                    "doc": inspect.getdoc(c.obj) or c.doc,
                    "params_schema": c.params_schema(),
                }
                for c in found
            ]
        )
        return 0
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    for c in found:
        console.print(f"[bold]{c.kind} [cyan]{escape(c.name)}[/cyan][/bold]  from {escape(c.distribution)} {c.version or ''}")
        console.print(escape(inspect.getdoc(c.obj) or c.doc or "(no documentation)"))
        rows = params_rows(c.params_model)
        if rows:
            table = Table(title="params", title_justify="left")
            for column in ("name", "type", "default", "description"):
                table.add_column(column)
            for row in rows:
                table.add_row(*map(escape, row))
            console.print(table)
        else:
            console.print("params: none")
        console.print()
    return 0


# -- validate / plan / train ---------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from grpo_plugins.config import ConfigError
    from grpo_plugins.validation import check_config

    _show_info_logs()  # the "TRL key ..." lines of a TRL GRPOConfig's keys
    check = check_config(args.config, num_processes=args.num_processes, overrides=args.set)
    if check.problems:
        raise ConfigError(check.problems, args.config)
    config = check.config
    console = _console()
    console.print(f"[green]{args.config}: valid[/green]")
    if config.dataset is not None:  # the task then only supplies default rewards (if any are used)
        from grpo_plugins.validation import describe_dataset

        console.print(f"  data: {describe_dataset(config.dataset)}, prompt column '{config.dataset.prompt_column}'",
                      soft_wrap=True)
    for name, component in check.components.items():
        if name == "task" and config.dataset is not None:
            continue
        console.print(f"  {name}: {component.name} ({component.distribution})")
    task = check.components.get("task")
    source = f" (task {task.name}'s defaults)" if check.rewards_from_task and task is not None else ""
    weights = config.reward_weights or [spec.weight for spec, _ in check.rewards]
    rewards = ", ".join(f"{spec.name} x {w:g}" for (spec, _), w in zip(check.rewards, weights))
    console.print(f"  rewards{source}: {rewards}")
    if check.plan is not None:
        p = check.plan
        console.print(
            f"  batch: {p.effective_batch_size} completions per generation = {p.unique_prompts} "
            f"{'prompt' if p.unique_prompts == 1 else 'prompts'} x "
            f"{p.num_generations}, {p.optimizer_steps_per_generation} optimizer step(s) per generation "
            f"on {p.num_processes} process(es)"
        )
        if p.group_filter is not None:
            console.print(
                f"  dynamic sampling: group_filter {p.group_filter}, up to {p.max_refill_rounds} refill round(s): "
                f"{p.effective_batch_size} to {p.max_generations_per_cycle} completions per generation"
            )
    for b in check.registry.broken:  # not used by this config, but installed and not loaded
        console.print(
            f"  [yellow]broken plugin (not loaded):[/yellow] {b.plugin} from {b.distribution} "
            f"{b.version or ''}: {b.error}",
            soft_wrap=True,
        )
    return 0


def _plan_from_args(args: argparse.Namespace) -> BatchPlan:
    from grpo_plugins.batching import make_plan, plan_from_config, world_size
    from grpo_plugins.config import GRPOConfig, load_config

    flags = {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}
    if args.config is not None or args.set:
        overrides = list(args.set) + [f"{k}={v}" for k, v in flags.items() if k != "num_processes"]
        if "steps_per_generation" in flags:
            overrides.append("generation_batch_size=null")
        if "generation_batch_size" in flags:
            overrides.append("steps_per_generation=null")
        config = load_config(args.config, overrides)
        return plan_from_config(config, flags.get("num_processes"))
    defaults = GRPOConfig.model_fields
    settings = {k: flags.get(k, defaults[k].default) for k in PLAN_FLAGS}
    if settings["num_processes"] is None:
        settings["num_processes"] = world_size()
    return make_plan(**settings)


def _cycle_name(n: int) -> str:
    return chr(ord("A") + n) if n < 26 else str(n)


def cmd_plan(args: argparse.Namespace) -> int:
    plan = _plan_from_args(args)
    if args.process is not None and not 0 <= args.process < plan.num_processes:
        raise GRPOPluginsError(f"--process must be between 0 and {plan.num_processes - 1}, got {args.process}")
    if args.json:
        sys.stdout.write(_plan_json(plan.to_json(cycles=args.cycles, process=args.process or 0)))
        return 0
    from rich.table import Table

    console = _console()
    p = plan
    formulas = [
        ("effective_batch_size", "steps_per_generation * num_processes * per_device_train_batch_size",
         f"{p.steps_per_generation} * {p.num_processes} * {p.per_device_train_batch_size}", p.effective_batch_size),
        ("optimizer_steps_per_generation", "steps_per_generation * num_iterations / gradient_accumulation_steps",
         f"{p.steps_per_generation} * {p.num_iterations} / {p.gradient_accumulation_steps}",
         p.optimizer_steps_per_generation),
        ("unique_prompts", "effective_batch_size / num_generations",
         f"{p.effective_batch_size} / {p.num_generations}", p.unique_prompts),
    ]
    if p.group_filter is not None:
        formulas.append(
            ("max_generations_per_cycle", "effective_batch_size * (1 + max_refill_rounds)",
             f"{p.effective_batch_size} * (1 + {p.max_refill_rounds})", p.max_generations_per_cycle)
        )
    for name, formula, numbers, value in formulas:
        console.print(f"{name:<30} = {formula} = {numbers} = [bold]{value}[/bold]", soft_wrap=True)
    if p.group_filter is not None:
        console.print(
            f"group_filter {p.group_filter}: a cycle generates {p.effective_batch_size} to {p.max_generations_per_cycle} "
            f"completions ({p.unique_prompts} to {p.max_prompts_per_cycle} prompts) for its "
            f"{p.optimizer_steps_per_generation} optimizer step(s). The batch columns below are group slots: "
            "each is filled at generation time by the next group the filter keeps; slots still empty after "
            "max_refill_rounds train on nothing.",
            soft_wrap=True,
        )
    processes = range(p.num_processes) if args.process is None or p.num_processes == 1 else [args.process]
    for n in range(args.cycles):
        table = Table(title=f"Generation cycle {_cycle_name(n)}", title_justify="left")
        table.add_column("step", justify="right")
        for proc in processes:
            table.add_column("batch" if p.num_processes == 1 else f"batch (process {proc})")
        table.add_column("notes")
        per_process = [p.cycle(n, proc) for proc in processes]
        for k, step in enumerate(per_process[0]):
            note = f"optimizer update (accumulated {p.gradient_accumulation_steps})" if step.optimizer_update else ""
            batches = [str(steps[k].batch).replace(" ", "") for steps in per_process]
            table.add_row(str(step.step), *batches, note)
        console.print(table)
    return 0


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


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced after set-up)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _show_info_logs() -> None:
    """The run's own notes (a GGUF conversion, a resume, float16 overflows) on stderr (once)."""
    log = logging.getLogger("grpo_plugins")
    if log.handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("grpo-plugins: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


# -- config reference ----------------------------------------------------------------------------


def render_config_reference() -> str:
    """docs/config.md: every config key with its type, default and description, from the models."""
    from grpo_plugins.config import (
        CONFIG_SECTIONS,
        SEED_ALIASES,
        ComponentRef,
        DatasetSpec,
        FSDPSettings,
        GRPOConfig,
        LoraSettings,
        ModelSpec,
        RewardSpec,
    )

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    def table(model: type[BaseModel], names: list[str]) -> list[str]:
        out = ["| key | type | default | description |", "|---|---|---|---|"]
        for name in names:
            f = model.model_fields[name]
            kind = " ".join(filter(None, [type_label(f.annotation), _constraints(f)]))
            out.append(
                f"| `{name}` | {cell(kind)} | `{cell(_default_label(f))}` | {cell(f.description or '')} |"
            )
        return out

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the pydantic models in grpo_plugins/config.py by",
        "     `grpo-plugins config-reference --output docs/config.md`; do not edit by hand. -->",
        "",
        "A run is configured by one YAML file of flat keys (as in TRL's `GRPOConfig`), overridable on",
        "the command line with `--set key=value` (the value is parsed as YAML; nested keys are dotted:",
        "`--set model.dtype=bfloat16`, `--set rewards.0.weight=0.5`). Unknown keys are errors with a",
        "suggestion. `grpo-plugins validate CONFIG` checks a file completely without loading a model.",
        "",
        f"Aliases: {', '.join(f'`{a}`' for a in SEED_ALIASES)} (for `per_device_train_batch_size` and",
        "`gradient_accumulation_steps`). `scale_rewards: true` means `group`, `false` means `none`.",
        "Every key of TRL 1.16's `GRPOConfig` is accepted too: [trl.md](trl.md) says what each one does here.",
        "A component key (`loss_type`, `importance_sampling_level`, `scale_rewards`,",
        "`rollout_correction`, `generator`, `task`) takes a registered name, `distribution:name`, or a",
        "mapping `{name: ..., params: {...}}` whose params the component's own model validates",
        "(`grpo-plugins show NAME` lists them).",
        "",
    ]
    fields = list(GRPOConfig.model_fields)
    starts = [fields.index(first) for first in CONFIG_SECTIONS] + [len(fields)]
    if starts[0] != 0:
        raise RuntimeError("CONFIG_SECTIONS must start with the first field of GRPOConfig")
    for (heading, start), end in zip(zip(CONFIG_SECTIONS.values(), starts), starts[1:]):
        lines += [f"## {heading}", "", *table(GRPOConfig, fields[start:end]), ""]
    for model in (ModelSpec, LoraSettings, FSDPSettings, DatasetSpec, ComponentRef, RewardSpec):
        doc = " ".join((inspect.getdoc(model) or "").split())
        lines += [f"## {model.__name__}", "", doc, "", *table(model, list(model.model_fields)), ""]
    return "\n".join(lines)


def cmd_config_reference(args: argparse.Namespace) -> int:
    return _write_reference(render_config_reference(), args, "config-reference")


def cmd_trl_reference(args: argparse.Namespace) -> int:
    from grpo_plugins.trl_compat import trl_table_markdown

    return _write_reference(trl_table_markdown(), args, "trl-reference")


def _write_reference(text: str, args: argparse.Namespace, command: str) -> int:
    if args.check:
        current = Path(args.output).read_text(encoding="utf-8") if Path(args.output).exists() else ""
        if current != text:
            raise GRPOPluginsError(f"{args.output} is out of date; run grpo-plugins {command} --output {args.output}")
        return 0
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    target = Path(args.output)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=target.parent or ".", delete=False, suffix=".tmp") as fh:
        fh.write(text)
    as_ordinary(fh.name)
    os.replace(fh.name, target)
    return 0


# -- argument parsing ----------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from grpo_plugins.kinds import KINDS

    parser = argparse.ArgumentParser(
        prog="grpo-plugins",
        description="A GRPO trainer in which every algorithmic choice is a plugin.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # --debug is also accepted after the command (SUPPRESS: absent there, the global value stays).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    def add_set(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a config key (value parsed as YAML; dotted keys for nested ones); repeatable",
        )

    p = command("list", "list the installed components and broken plugins")
    p.add_argument("--kind", choices=list(KINDS), help="only this kind")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = command("show", "a component's documentation and params")
    p.add_argument("name", help="component name, or distribution:name")
    p.add_argument("--kind", choices=list(KINDS), help="only this kind")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_show)

    p = command("validate", "check a config completely, without loading a model")
    p.add_argument("config", help="YAML config file")
    add_set(p)
    p.add_argument("--num-processes", type=_positive_int, help="processes for the batch check (default: config, WORLD_SIZE, 1)")
    p.set_defaults(func=cmd_validate)

    p = command("plan", "show the batch arithmetic and generation cycles")
    p.add_argument("config", nargs="?", help="YAML config file (the flags override it)")
    add_set(p)
    for name in PLAN_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_positive_int, metavar="N")
    p.add_argument("--cycles", type=_positive_int, default=2, help="generation cycles to show (default 2)")
    p.add_argument("--process", type=int, default=None, help="show this process (default: all; JSON: 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (its shape: docs/cli.md)")
    p.set_defaults(func=cmd_plan)

    p = command("train", "run GRPO training")
    p.add_argument("config", help="YAML config file")
    add_set(p)
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                   help="continue from the last checkpoint (of output_dir, or of DIR)")
    p.set_defaults(func=cmd_train)

    p = command("eval", "evaluate a checkpoint (or the untrained model) on the config's eval prompts")
    p.add_argument("config", help="YAML config file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", metavar="PATH",
                       help="a checkpoint, a run directory (its newest checkpoint) or a model directory; "
                            "default: the newest checkpoint in the config's output_dir")
    which.add_argument("--base", action="store_true", help="evaluate the config's model untrained (no adapter)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_set(p)
    p.set_defaults(func=cmd_eval)

    p = command("export", "write a trained policy as a transformers checkpoint (LoRA merged) and/or a GGUF file")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run's output directory (its latest checkpoint) or a checkpoint")
    p.add_argument("--out", metavar="DIR", help="folder for the merged transformers checkpoint")
    p.add_argument("--gguf", metavar="FILE", help="also (or only) write a GGUF file for llama.cpp / Ollama")
    p.add_argument("--gguf-type", choices=["f16", "bf16", "q8_0"], default="f16", help="GGUF weight type (default f16)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="dtype of the transformers checkpoint (default: the run's dtype; float32 for auto)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder or --gguf file")
    p.set_defaults(func=cmd_export)

    p = command("report", "write a self-contained HTML report of a run (curves, config, sample completions)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    p.add_argument("--out", metavar="FILE.html", help="where to write it (default: RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)

    p = command("config-reference", "print (or write) the config reference in Markdown")
    p.add_argument("--output", "-o", default=None, help="file to write (default: stdout)")
    p.add_argument("--check", action="store_true", help="exit 2 if --output is not up to date")
    p.set_defaults(func=cmd_config_reference)
    p = command("trl-reference", "print (or write) docs/trl.md: every TRL GRPOConfig key and what it does here")
    p.add_argument("--output", "-o", default=None, help="file to write (default: stdout)")
    p.add_argument("--check", action="store_true", help="exit 2 if --output is not up to date")
    p.set_defaults(func=cmd_trl_reference)
    return parser


def _version() -> str:
    from grpo_plugins import __version__

    return __version__


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that are the user's mistake (printed as one line, exit 2)."""
    errors: list[type[BaseException]] = [GRPOPluginsError]
    for module, name in (("pydantic", "ValidationError"), ("yaml", "YAMLError")):
        mod = sys.modules.get(module)  # only if already imported: never import them for this
        if mod is not None:
            errors.append(getattr(mod, name))
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    misuse = _set_misuse(argv)
    if misuse is not None:
        _error(misuse)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if args.command in ("config-reference", "trl-reference") and args.check and args.output is None:
        parser.error("--check needs --output")
    from grpo_plugins import console as run_console

    previous = warnings.showwarning
    warnings.showwarning = _warnings_printer(previous)
    run_console.show_library_output(args.debug)
    quiet = run_console.drop_known_noise()
    quiet.__enter__()
    try:
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        _console(stderr=True).print("[yellow]interrupted[/yellow]")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug or not isinstance(exc, _user_errors()):
            if not args.debug:
                _error(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)")
                return 1
            raise
        _error(str(exc))
        return EXIT_USAGE
    finally:
        warnings.showwarning = previous
        quiet.__exit__(None, None, None)
        run_console.show_library_output(False)


def _set_misuse(argv: Sequence[str]) -> str | None:
    """The message for ``--set KEY VALUE`` (two arguments; argparse would only say
    "unrecognized arguments"), or None."""
    for i, token in enumerate(argv[:-1]):
        key = argv[i + 1]
        if token != "--set" or "=" in key or key.startswith("-"):
            continue
        value = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("--") else "VALUE"
        return f"--set takes KEY=VALUE as one argument: write --set {key}={value}"
    return None


def _warnings_printer(previous: Callable[..., None]) -> Callable[..., None]:
    """Our own warnings (batch plan, config) as one yellow line; everyone else's unchanged."""

    def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if category.__module__.startswith("grpo_plugins"):
            _show_warning(message, category, *rest, **kw)
        else:
            previous(message, category, *rest, **kw)

    return show


if __name__ == "__main__":
    sys.exit(main())
