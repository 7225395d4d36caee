"""The ``grpo-plugins`` command line: list/show plugins, validate and plan configs, train, evaluate.

Every user mistake (a :class:`~grpo_plugins.errors.GRPOPluginsError`, a bad YAML file) is
printed as one red message on stderr with exit status 2, never a traceback (``--debug`` shows
it). Ctrl-C exits with 130. Heavy modules are imported only by the commands that need them.

This module parses the arguments and runs a command; the commands live beside it:
:mod:`~grpo_plugins.cli.components` (list, show), :mod:`~grpo_plugins.cli.config_checks`
(validate, plan), :mod:`~grpo_plugins.cli.runs` (train, eval, export, report) and
:mod:`~grpo_plugins.cli.reference` (config-reference, trl-reference).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from grpo_plugins.cli.components import cmd_list, cmd_show, params_rows, type_label
from grpo_plugins.cli.config_checks import PLAN_FLAGS, cmd_plan, cmd_validate
from grpo_plugins.cli.output import EXIT_INTERRUPTED, EXIT_USAGE, _console, _error, _show_warning
from grpo_plugins.cli.reference import cmd_config_reference, cmd_trl_reference, render_config_reference
from grpo_plugins.cli.runs import cmd_eval, cmd_export, cmd_report, cmd_train
from grpo_plugins.errors import GRPOPluginsError

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "build_parser",
    "main",
    "params_rows",
    "render_config_reference",
    "type_label",
]


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
    """Our own warnings (batch plan, config) as one yellow line, each text once per command (the
    config is checked before a run and again when the run plans its batches; Python's own
    once-per-place memory is reset whenever a library leaves a ``catch_warnings`` block);
    everyone else's unchanged."""
    shown: set[tuple[type[Warning], str]] = set()

    def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if category.__module__.startswith("grpo_plugins"):
            if (category, str(message)) in shown:
                return
            shown.add((category, str(message)))
            _show_warning(message, category, *rest, **kw)
        else:
            previous(message, category, *rest, **kw)

    return show

