"""A training subprocess that SIGKILLs itself at a named point, for the kill -9 / resume tests
(tests/test_reliability_kill.py, tests/test_fsdp.py).

``install_kill("micro:5")`` kills the process on the 5th training forward, ``"generate:2"`` on
the 2nd call of the transformers generator, ``"checkpoint:1"`` while the 1st checkpoint is
being written (when ``checkpoint_file`` is saved: a file written mid-checkpoint).
"""

from __future__ import annotations

import os
import signal
from typing import Any


def install_kill(spec: str, checkpoint_file: str = "optimizer.pt") -> None:
    """Make this process SIGKILL itself on the n-th time it reaches the named point."""
    import torch

    import grpo_plugins.logprobs
    from grpo_plugins.registry import get_registry

    point, n = spec.split(":")
    seen = [0]

    def reached() -> None:
        seen[0] += 1
        if seen[0] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "generate":
        cls = get_registry().get("generator", "transformers").obj
        original_generate = cls.generate

        def generate(self: Any, prompt_ids: Any) -> Any:
            reached()
            return original_generate(self, prompt_ids)

        cls.generate = generate
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
