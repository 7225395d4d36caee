"""``grpo-plugins validate`` and ``plan``: what a config means, checked without loading a model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from grpo_plugins.cli.output import _console, _show_info_logs
from grpo_plugins.errors import GRPOPluginsError

if TYPE_CHECKING:
    from grpo_plugins.batching import BatchPlan


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


def _plan_json(data: dict[str, Any]) -> str:
    """The plan's JSON with one line per step (valid JSON, readable in a terminal)."""
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "cycles")
    cycles = ",\n".join(
        '  {"steps": [\n' + ",\n".join(f"    {json.dumps(step)}" for step in cycle["steps"]) + "\n  ]}"
        for cycle in data["cycles"]
    )
    return "{" + head + ', "cycles": [\n' + cycles + "\n]}\n"


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
