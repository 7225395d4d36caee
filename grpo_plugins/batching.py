"""Batch arithmetic and the generation-cycle planner (a pure module: no torch, no I/O).

One *generation cycle* generates ``effective_batch_size`` completions over all processes
(``unique_prompts`` prompts x ``num_generations`` completions, groups consecutive) and then
trains on them for ``steps_per_generation * num_iterations`` micro-steps, taking an optimizer
step after every ``gradient_accumulation_steps`` micro-steps::

    effective_batch_size           = steps_per_generation * num_processes * per_device_train_batch_size
    optimizer_steps_per_generation = steps_per_generation * num_iterations / gradient_accumulation_steps
    unique_prompts                 = effective_batch_size / num_generations

Process ``p`` owns completions ``[p*L, (p+1)*L)`` of each generation batch, with
``L = steps_per_generation * per_device_train_batch_size``; micro-step ``k`` of a cycle trains on
rows ``(k % steps_per_generation) * per_device_train_batch_size`` ... ``+ per_device_train_batch_size``
of that share. Completion ``c`` of cycle ``n`` belongs to prompt ``n * unique_prompts + c // num_generations``.
A group may therefore span micro-batches and processes; rewards are gathered before group
statistics are taken.

With a ``group_filter`` that drops groups (DAPO's dynamic sampling) a cycle generates one to
``1 + max_refill_rounds`` such batches and keeps ``unique_prompts`` groups of them; the plan's
prompt indices then name group *slots*, and :attr:`BatchPlan.max_generations_per_cycle` is what a
cycle may cost.

``grpo-plugins plan`` prints these plans; the engine consumes exactly the same objects.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

from grpo_plugins.errors import GRPOPluginsError

__all__ = ["BatchPlan", "BatchPlanError", "BatchPlanWarning", "Step", "make_plan", "plan_from_config", "world_size"]


class BatchPlanError(GRPOPluginsError, ValueError):
    """The batch settings do not fit together; the message names the setting to change."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field  # the config field the message is about


class BatchPlanWarning(UserWarning):
    """Batch settings that work but are probably not what was meant."""


@dataclass(frozen=True)
class Step:
    """One micro-step of a generation cycle, seen from one process.

    Attributes:
        step: index of the micro-step within its cycle (0-based, as ``grpo-plugins plan`` numbers them).
        batch: for each completion of the micro-batch, the index of its prompt (in dataset order
            within the run, counting on across cycles).
        optimizer_update: whether the optimizer steps after this micro-step.
        rows: the micro-batch's rows within this process's share of the generation batch.
    """

    step: int
    batch: list[int]
    optimizer_update: bool
    rows: slice

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "batch": list(self.batch), "optimizer_update": self.optimizer_update}


@dataclass(frozen=True)
class BatchPlan:
    """The resolved batch settings of a run and the schedule of every generation cycle."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_generations: int
    steps_per_generation: int
    num_processes: int
    num_iterations: int
    effective_batch_size: int
    optimizer_steps_per_generation: int
    unique_prompts: int
    #: The run's group filter when it drops groups (dynamic sampling), else None.
    group_filter: str | None = None
    #: Most extra generation rounds per cycle (0 without a dropping group filter).
    max_refill_rounds: int = 0

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per round over all processes (= effective_batch_size)."""
        return self.effective_batch_size

    @property
    def max_generations_per_cycle(self) -> int:
        """Most completions one cycle may generate: one round plus ``max_refill_rounds`` more."""
        return self.effective_batch_size * (1 + self.max_refill_rounds)

    @property
    def max_prompts_per_cycle(self) -> int:
        """Most prompts one cycle may consume from the prompt stream."""
        return self.unique_prompts * (1 + self.max_refill_rounds)

    @property
    def completions_per_process(self) -> int:
        """Completions of each generation batch that one process trains on (L)."""
        return self.steps_per_generation * self.per_device_train_batch_size

    @property
    def steps_per_cycle(self) -> int:
        """Micro-steps per generation cycle: steps_per_generation * num_iterations."""
        return self.steps_per_generation * self.num_iterations

    @property
    def on_policy(self) -> bool:
        """True when no optimizer update falls inside a cycle, so old log-probs equal the
        current ones and need not be computed."""
        return self.gradient_accumulation_steps == self.steps_per_cycle

    def process_rows(self, process: int = 0) -> slice:
        """The completions of a generation batch that ``process`` trains on."""
        self._check_process(process)
        size = self.completions_per_process
        return slice(process * size, (process + 1) * size)

    def prompt_indices(self, cycle: int) -> list[int]:
        """For each completion of cycle ``cycle``'s whole generation batch, its prompt's index."""
        first = cycle * self.unique_prompts
        return [first + c // self.num_generations for c in range(self.effective_batch_size)]

    def cycle(self, cycle: int, process: int = 0) -> list[Step]:
        """The micro-steps of generation cycle ``cycle`` as process ``process`` runs them."""
        if cycle < 0:
            raise ValueError(f"cycle must be >= 0, got {cycle}")
        share = self.prompt_indices(cycle)[self.process_rows(process)]
        bs = self.per_device_train_batch_size
        steps = []
        for k in range(self.steps_per_cycle):
            start = (k % self.steps_per_generation) * bs
            steps.append(
                Step(
                    step=k,
                    batch=share[start : start + bs],
                    optimizer_update=(k + 1) % self.gradient_accumulation_steps == 0,
                    rows=slice(start, start + bs),
                )
            )
        return steps

    def to_json(self, cycles: int = 2, process: int = 0) -> dict[str, Any]:
        """The plan as ``grpo-plugins plan --json`` prints it (docs/cli.md), for ``process``."""
        return {
            "effective_batch_size": self.effective_batch_size,
            "optimizer_steps_per_generation": self.optimizer_steps_per_generation,
            "unique_prompts": self.unique_prompts,
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.steps_per_generation,
            "num_generations": self.num_generations,
            "num_processes": self.num_processes,
            "num_iterations": self.num_iterations,
            "process": process,
            **self._group_filter_json(),
            "cycles": [
                {"steps": [s.to_json() for s in self.cycle(n, process)]} for n in range(cycles)
            ],
        }

    def _group_filter_json(self) -> dict[str, Any]:
        if self.group_filter is None:
            return {}
        return {
            "group_filter": self.group_filter,
            "max_refill_rounds": self.max_refill_rounds,
            "generations_per_cycle": {"min": self.effective_batch_size, "max": self.max_generations_per_cycle},
            "prompts_per_cycle": {"min": self.unique_prompts, "max": self.max_prompts_per_cycle},
        }

    def _check_process(self, process: int) -> None:
        if not 0 <= process < self.num_processes:
            raise ValueError(f"process must be in [0, {self.num_processes}), got {process}")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchPlanError(f"{name} must be a positive whole number, got {value!r}", name)
    return value


def make_plan(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    steps_per_generation: int | None = None,
    generation_batch_size: int | None = None,
    num_processes: int = 1,
    num_iterations: int = 1,
) -> BatchPlan:
    """Check the batch settings and resolve them into a :class:`BatchPlan`.

    Args:
        per_device_train_batch_size: completions per process per micro-step.
        gradient_accumulation_steps: micro-steps per optimizer update.
        num_generations: completions per prompt (G), at least 2.
        steps_per_generation: micro-steps per generation; None: ``gradient_accumulation_steps``
            (or derived from ``generation_batch_size``).
        generation_batch_size: completions per generation over all processes, instead of
            ``steps_per_generation``.
        num_processes: number of training processes.
        num_iterations: optimisation passes (mu) over each generation batch.

    Raises:
        BatchPlanError: naming the setting to change. Emits :class:`BatchPlanWarning` for
            ``num_generations == 2``.
    """
    bs = _positive("per_device_train_batch_size", per_device_train_batch_size)
    ga = _positive("gradient_accumulation_steps", gradient_accumulation_steps)
    procs = _positive("num_processes", num_processes)
    mu = _positive("num_iterations", num_iterations)
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise BatchPlanError(
            f"num_generations must be at least 2 (GRPO compares completions within a group), got "
            f"{num_generations!r}; set num_generations to 2 or more (8 is typical)",
            "num_generations",
        )
    if num_generations == 2:
        warnings.warn(
            "num_generations is 2: each group has only two completions, so the group statistics "
            "are very noisy (GRPO needs more than 2); consider 4 or more",
            BatchPlanWarning,
            stacklevel=2,
        )
    if steps_per_generation is not None and generation_batch_size is not None:
        raise BatchPlanError(
            "steps_per_generation and generation_batch_size are mutually exclusive; set only one "
            "of them (generation_batch_size = steps_per_generation * num_processes * "
            "per_device_train_batch_size)",
            "steps_per_generation",
        )
    per_step = procs * bs  # completions per micro-step over all processes
    if generation_batch_size is not None:
        gbs = _positive("generation_batch_size", generation_batch_size)
        if gbs % per_step:
            lower = max(per_step, gbs // per_step * per_step)
            raise BatchPlanError(
                f"generation_batch_size ({gbs}) must be a multiple of num_processes * "
                f"per_device_train_batch_size ({procs} * {bs} = {per_step}); set it to "
                f"{lower} or {lower + per_step}, or set steps_per_generation instead",
                "generation_batch_size",
            )
        spg = gbs // per_step
    elif steps_per_generation is not None:
        spg = _positive("steps_per_generation", steps_per_generation)
    else:
        spg = ga
    effective = spg * per_step
    if effective % num_generations:
        raise BatchPlanError(
            f"the effective batch size ({spg} steps_per_generation * {procs} num_processes * {bs} "
            f"per_device_train_batch_size = {effective}) is not divisible by num_generations "
            f"({num_generations}); change per_device_train_batch_size, steps_per_generation "
            f"(or gradient_accumulation_steps) or num_generations so that it is, e.g. "
            f"num_generations to a divisor of {effective} or steps_per_generation to "
            f"{math.lcm(per_step, num_generations) // per_step}",
            "num_generations",
        )
    cycle_steps = spg * mu
    if cycle_steps % ga:
        raise BatchPlanError(
            f"gradient_accumulation_steps ({ga}) must divide steps_per_generation * num_iterations "
            f"({spg} * {mu} = {cycle_steps}) so that no optimizer update straddles two generation "
            f"batches; set gradient_accumulation_steps to a divisor of {cycle_steps}, or "
            f"steps_per_generation to a multiple of {ga}",
            "gradient_accumulation_steps",
        )
    return BatchPlan(
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        num_generations=num_generations,
        steps_per_generation=spg,
        num_processes=procs,
        num_iterations=mu,
        effective_batch_size=effective,
        optimizer_steps_per_generation=cycle_steps // ga,
        unique_prompts=effective // num_generations,
    )


def plan_from_config(config: Any, num_processes: int | None = None, registry: Any = None) -> BatchPlan:
    """The batch plan of a :class:`~grpo_plugins.config.GRPOConfig`.

    ``num_processes`` defaults to ``config.num_processes``, then the ``WORLD_SIZE`` environment
    variable (set by ``accelerate launch`` / torchrun), then 1. The config's ``group_filter`` is
    looked up in ``registry`` (default: the run's) to know whether cycles may generate more.
    """
    if num_processes is None:
        num_processes = config.num_processes or world_size()
    plan = make_plan(
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_generations=config.num_generations,
        steps_per_generation=config.steps_per_generation,
        generation_batch_size=config.generation_batch_size,
        num_processes=num_processes,
        num_iterations=config.num_iterations,
    )
    name = dropping_group_filter(config, registry)
    if name is None:
        return plan
    return dataclasses.replace(plan, group_filter=name, max_refill_rounds=config.max_refill_rounds)


def dropping_group_filter(config: Any, registry: Any = None) -> str | None:
    """The name of the config's ``group_filter`` when that filter may drop groups, else None.

    Raises:
        BatchPlanError: the filter is not registered (field ``group_filter``).
    """
    value = getattr(config, "group_filter", None)
    if value is None:
        return None
    from grpo_plugins.config import component_ref
    from grpo_plugins.registry import registry_for

    ref = component_ref(value)
    assert ref is not None
    registry = registry if registry is not None else registry_for(config.disable_plugins)
    try:
        component = registry.get("group_filter", ref.name)
    except GRPOPluginsError as exc:
        raise BatchPlanError(str(exc), "group_filter") from None
    return ref.name if getattr(component.obj, "drops_groups", True) else None


def world_size() -> int:
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        return max(1, int(raw)) if raw else 1
    except ValueError:
        raise BatchPlanError(
            f"the WORLD_SIZE environment variable must be a whole number, got {raw!r}", "num_processes"
        ) from None
