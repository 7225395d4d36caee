"""What a run shows on the console: the phase it is in, each step's rewards, an ETA, and nothing
from the libraries underneath.

:class:`RunConsole` is a live rich display in a terminal (a bar with the step, seconds per step,
the ETA and the current phase, and a line with the weighted reward, every reward component, the
KL and the completion length) and plain lines elsewhere (a log file, CI, a cluster job). Any
module says what the run is doing with :func:`phase` (``"loading model"``, ``"generating step
3"``); it does nothing when no run is showing progress.

:func:`quiet_libraries` keeps third-party progress bars and notices (transformers' "Loading
weights", datasets' "Generating train split", bitsandbytes' missing-kernel warning) out of a
run's output; :func:`show_library_output` (the command line's ``--debug``) lets them through.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

__all__ = [
    "GracefulStop",
    "KNOWN_NOISE",
    "RunConsole",
    "clock",
    "drop_known_noise",
    "first_and_last",
    "metrics_parts",
    "phase",
    "print_completions",
    "quiet_libraries",
    "show_library_output",
]

#: Without a terminal, phases are printed before the first step, then only while steps take at
#: least this long on average (a line per phase of a 1-second step would drown the log).
SLOW_STEP_SECONDS = 30.0

_current: RunConsole | None = None
_library_output = False


def phase(text: str) -> None:
    """Say what the run in progress is doing now (shown until the next phase)."""
    if _current is not None:
        _current.set_phase(text)


def show_library_output(show: bool) -> None:
    """Let third-party progress bars and notices through (True) or keep them out (False)."""
    global _library_output
    _library_output = show


#: Third-party log lines with nothing for a user to act on, as (logger, start of the message).
KNOWN_NOISE: tuple[tuple[str, str], ...] = (
    # peft imports bitsandbytes on every run; on a CPU with AVX512-BF16, bitsandbytes then looks
    # for an optional kernel package ("pip install kernels") and, without it, uses its own
    # kernels -- even when nothing is quantised.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
)


class _MessageFilter(logging.Filter):
    """Drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def drop_known_noise() -> Iterator[None]:
    """The :data:`KNOWN_NOISE` log lines are dropped inside the block (no module is imported)."""
    if _library_output:
        yield
        return
    installed = []
    for name, prefix in KNOWN_NOISE:
        logger, noise_filter = logging.getLogger(name), _MessageFilter(prefix)
        logger.addFilter(noise_filter)
        installed.append((logger, noise_filter))
    try:
        yield
    finally:
        for logger, noise_filter in installed:
            logger.removeFilter(noise_filter)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside the block: no progress bars from transformers, datasets and huggingface_hub, only
    their errors, and none of :data:`KNOWN_NOISE`. Imports those libraries (for code that loads
    models anyway); the previous settings come back afterwards."""
    if _library_output:
        yield
        return
    restore: list[Any] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(drop_known_noise())
        for name in ("transformers.utils.logging", "datasets.utils.logging"):  # the same logging API
            try:
                lib = importlib.import_module(name)
            except ImportError:
                continue
            if lib.is_progress_bar_enabled():
                lib.disable_progress_bar()
                restore.append(lib.enable_progress_bar)
            restore.append(functools.partial(lib.set_verbosity, lib.get_verbosity()))
            lib.set_verbosity_error()
        try:
            import huggingface_hub.utils as hub_utils

            if not hub_utils.are_progress_bars_disabled():
                hub_utils.disable_progress_bars()
                restore.append(hub_utils.enable_progress_bars)
        except ImportError:
            pass
        try:
            yield
        finally:
            for undo in reversed(restore):
                undo()


def first_and_last(records: Sequence[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """The mean of ``key`` over the first and over the last quarter of ``records`` (at least one
    record each); None when no record has it."""
    values = [float(r[key]) for r in records if key in r and r[key] is not None]
    if not values:
        return None
    n = max(1, len(values) // 4)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def clock(seconds: float) -> str:
    """``1:02:03``."""
    s = int(max(seconds, 0.0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class GracefulStop:
    """Ctrl-C while a step trains asks the run to stop after that optimizer step (a checkpoint
    taken there resumes exactly); anywhere else, or pressed again, it stops at once.

    The run marks its training phases with ``training_now`` and reads ``requested`` between
    optimizer steps.
    """

    def __init__(self, console: RunConsole) -> None:
        self.console = console
        self.training_now = False
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route Ctrl-C through this object in the block (main thread, default handler only)."""
        import os
        import signal
        import threading

        # Several processes could catch one Ctrl-C in different phases and disagree on where to
        # save (a collective): they stop at once.
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if several or threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        signal.signal(signal.SIGINT, self._interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self.training_now and not self.requested:
            self.requested = True
            self.console.print(
                "Ctrl-C: saving a checkpoint when the optimizer step in progress ends (Ctrl-C again to stop at once)"
            )
            return
        raise KeyboardInterrupt


class RunConsole:
    """A run's progress on the console (see the module docstring).

    Use it as a context manager around the run; while it is open, :func:`phase` reaches it.

    Args:
        enabled: False on processes other than the main one (nothing is shown).
        interactive: a live display (a terminal) or plain lines; default: whether stdout is a
            terminal.
        file: where plain lines go (default: sys.stdout at the time of printing).
    """

    def __init__(self, *, enabled: bool = True, interactive: bool | None = None, file: TextIO | None = None) -> None:
        self.enabled = enabled
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._file = file
        self.total_steps: int | None = None
        self.start_step = 0
        self.step = 0
        self.metrics: dict[str, float] = {}
        self.phase = ""
        self._phase_since = time.monotonic()
        self._begun = time.monotonic()
        self._last_step_at = self._begun
        self.compiling = False  # the first step compiles (compiled layers, a CUDA graph): say so
        self._progress: Any = None
        self._task: Any = None
        self._previous: RunConsole | None = None
        self._quiet: contextlib.ExitStack | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> RunConsole:
        global _current
        self._previous, _current = _current, self if self.enabled else _current
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(quiet_libraries())
        if self.enabled and self.interactive:
            self._progress = _LiveProgress(self)
            self._task = self._progress.add_task("train", total=None, pace="", eta="", phase="")
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live display (its last state stays on the screen)."""
        global _current
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
            _current = self._previous

    # -- what the run reports ---------------------------------------------------------------------

    def begin(self, total_steps: int, start_step: int = 0) -> None:
        """The steps are known: ``total_steps`` in all, ``start_step`` of them done before (a resume)."""
        self.total_steps, self.start_step, self.step = total_steps, start_step, start_step
        self._begun = self._last_step_at = time.monotonic()
        if self._progress is not None:
            self._progress.update(self._task, total=total_steps, completed=start_step)

    def set_phase(self, text: str) -> None:
        """What the run is doing now; without a terminal, printed before the first step and while
        steps are slow."""
        if self.compiling and self.step == self.start_step and text.endswith(f"step {self.start_step + 1}"):
            text += " (compiling first)"
        if text == self.phase:
            return
        self.phase, self._phase_since = text, time.monotonic()
        if not self.enabled or self.interactive:
            return
        per_step = self.seconds_per_step()
        if per_step is None or per_step >= SLOW_STEP_SECONDS:
            self.print(f"grpo-plugins: {text}...")

    def step_done(self, step: int, record: dict[str, float]) -> None:
        """An optimizer step finished with the metrics ``record``."""
        self.step, self.metrics = step, dict(record)
        self._last_step_at = time.monotonic()
        self.phase = ""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """A logging window was written: one line without a terminal."""
        if step > self.step:  # logged without step_done (a writer used on its own)
            self.step, self._last_step_at = step, time.monotonic()
        if self.enabled and not self.interactive:
            self.print(self.line(step, metrics))

    def print(self, text: str) -> None:
        """One line of text (above the live display in a terminal)."""
        if not self.enabled:
            return
        if self._progress is not None:
            from rich.markup import escape

            self._progress.console.print(escape(text), soft_wrap=True)
        else:
            print(text, file=self._file or sys.stdout, flush=True)

    # -- numbers ----------------------------------------------------------------------------------

    def seconds_per_step(self) -> float | None:
        """The mean wall time of this run's steps so far (None before the first)."""
        done = self.step - self.start_step
        return (self._last_step_at - self._begun) / done if done > 0 else None

    def eta(self) -> str:
        """The time left at the mean step time so far, counting down while a step runs
        (``-:--:--`` before the first step)."""
        per_step = self.seconds_per_step()
        if per_step is None or self.total_steps is None:
            return "-:--:--"
        running = time.monotonic() - self._last_step_at
        return clock(max(self.total_steps - self.step, 0) * per_step - min(running, per_step))

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """The compact line of a logged step: step, reward and each reward component, KL, mean
        completion length, seconds per step and the time left."""
        parts = [f"step {step}/{self.total_steps if self.total_steps is not None else '?'}"]
        parts += metrics_parts(metrics)
        per_step = self.seconds_per_step()
        if per_step is not None:
            parts.append(f"{metrics.get('timing/step', per_step):.2f} s/step")
            parts.append(f"ETA {self.eta()}")
        return " | ".join(parts)


def metrics_parts(metrics: dict[str, float]) -> list[str]:
    """``reward 0.5``, ``correct_answer 0.25 format 1.0``, ``kl 0.0012``, ``len 42.0`` (those logged)."""
    parts = [f"reward {metrics.get('reward', math.nan):.3f}"]
    components = [
        f"{key[len('rewards/'):-len('/mean')]} {value:.3f}"
        for key, value in metrics.items()
        if key.startswith("rewards/") and key.endswith("/mean")
    ]
    if components:
        parts.append(" ".join(components))
    if "kl" in metrics:
        parts.append(f"kl {metrics['kl']:.4f}")
    if "completions/mean_length" in metrics:
        parts.append(f"len {metrics['completions/mean_length']:.1f}")
    return parts


def _live_progress_class() -> type:
    from rich.console import Group
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.text import Text

    class LiveProgress(Progress):
        """The bar (step, s/step, ETA, phase) and under it the last step's rewards."""

        def __init__(self, run: RunConsole) -> None:
            self.run = run
            super().__init__(
                TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[pace]}"), TextColumn("[cyan]{task.fields[eta]}"),
                TextColumn("[yellow]{task.fields[phase]}"),
                refresh_per_second=2,
            )

        def get_renderables(self) -> Any:
            run = self.run
            for task in self.tasks:  # recomputed at each refresh: the phase's clock keeps moving
                per_step = run.seconds_per_step()
                task.fields["pace"] = f"{per_step:.1f} s/step" if per_step is not None else ""
                task.fields["eta"] = f"ETA {run.eta()}"
                since = time.monotonic() - run._phase_since
                task.fields["phase"] = f"{run.phase} ({since:.0f} s)" if run.phase else ""
            table = self.make_tasks_table(self.tasks)
            if run.metrics:
                yield Group(table, Text("  " + " | ".join(metrics_parts(run.metrics)), style="dim"))
            else:
                yield table

    return LiveProgress


def _LiveProgress(run: RunConsole) -> Any:  # noqa: N802 -- rich is imported only when a terminal shows it
    return _live_progress_class()(run)


def print_completions(records: list[dict[str, Any]], limit: int, *, unique_prompts: bool = False, step: int = 0) -> list[dict[str, Any]]:
    """Print up to ``limit`` completions of a step as a table on stderr (TRL's
    ``num_completions_to_print``; ``log_unique_prompts``: the first completion of each prompt
    only). Returns the records printed."""
    from rich.console import Console
    from rich.table import Table

    shown: list[dict[str, Any]] = []
    seen: set[str] = set()
    for record in records:
        key = repr(record["prompt"])
        if unique_prompts and key in seen:
            continue
        seen.add(key)
        shown.append(record)
        if len(shown) >= limit:
            break
    table = Table(title=f"completions, step {step}", show_lines=True)
    for column in ("prompt", "completion", "rewards", "advantage"):
        table.add_column(column)
    for r in shown:
        prompt = r["prompt"] if isinstance(r["prompt"], str) else str(r["prompt"][-1].get("content", r["prompt"]))
        rewards = ", ".join(f"{k}={v:.3g}" if v is not None else f"{k}=None" for k, v in r["rewards"].items())
        table.add_row(prompt, r["completion"], rewards, f"{r['advantage']:.3g}")
    Console(file=sys.stderr, width=120).print(table)
    return shown
