"""What the commands print: rich consoles on stdout and stderr, one-line errors and warnings,
JSON, and the run's own INFO notes."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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
