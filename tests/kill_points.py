"""A training subprocess that SIGKILLs itself at a named point, for the kill -9 / resume tests
(tests/test_reliability_kill.py, tests/test_fsdp.py).

``install_kill("micro:5")`` kills the process on the 5th training forward, ``"generate:2"`` on
the 2nd generation (:func:`before_each_generation`), ``"checkpoint:1"`` while the 1st checkpoint is
being written (when ``checkpoint_file`` is saved: a file written mid-checkpoint).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any


def install_kill(spec: str, checkpoint_file: str = "optimizer.pt") -> None:
    """Make this process SIGKILL itself on the n-th time it reaches the named point."""
    import torch

    import grpo_plugins.logprobs

    point, n = spec.split(":")
    seen = [0]

    def reached() -> None:
        seen[0] += 1
        if seen[0] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "generate":
        before_each_generation(reached)
    elif point == "micro":
        original_logps = grpo_plugins.logprobs.completion_logps

        def completion_logps(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # the training forward, not the old-log-prob pass
                reached()
            return original_logps(*args, **kwargs)

        grpo_plugins.logprobs.completion_logps = completion_logps
    elif point == "checkpoint":
        original_save = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if str(f).endswith(checkpoint_file):
                reached()
            return original_save(obj, f, *args, **kwargs)

        torch.save = save
    else:
        raise ValueError(f"unknown kill point {point!r}")


def before_each_generation(hook: Callable[[], None], setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Call ``hook`` before each generation of a run, whichever built-in generator makes it
    (``static``, the default, or ``transformers``); once where ``static`` hands a model it
    cannot run to ``transformers``. ``setattr``: e.g. a monkeypatch's, to undo it after a test."""
    from grpo_plugins.registry import get_registry

    depth = [0]
    for name in ("static", "transformers"):
        cls = get_registry().get("generator", name).obj

        def generate(self: Any, prompt_ids: Any, _original: Any = cls.generate) -> Any:
            if depth[0] == 0:
                hook()
            depth[0] += 1
            try:
                return _original(self, prompt_ids)
            finally:
                depth[0] -= 1

        setattr(cls, "generate", generate)
