"""Step timing and logging: what the engine adds to each optimizer step's metrics, and when a
logging window is written.

Timing counts since the previous optimizer step: generation, reward, log-prob and rollout seconds (a
rollout happens once per cycle, so the step after it carries them), training seconds, and the
tokens processed, for ``timing/*`` and ``tokens_per_second``.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from grpo_plugins.metrics import MetricsWriter, average


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory of the process (CUDA), or its peak resident memory (elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepLog:
    """Times the steps of a run and writes their metrics.

    Args:
        writer: where logged steps go.
        logging_steps: average and write every this many optimizer steps.
        total_steps: the run's last step (always written).
        device: for the peak memory metric.
        window: records of the current logging window restored from a checkpoint.

    Attributes:
        window: the records since the last write (saved in checkpoints).
        history: every record written, with its ``step``.
        last_logged: the metrics of the last write.
    """

    def __init__(
        self,
        writer: MetricsWriter,
        logging_steps: int,
        total_steps: int,
        device: torch.device,
        window: list[dict[str, float]] | None = None,
    ) -> None:
        self.writer, self.logging_steps, self.total_steps, self.device = writer, logging_steps, total_steps, device
        self.window: list[dict[str, float]] = list(window or [])
        self.history: list[dict[str, float]] = []
        self.last_logged: dict[str, float] = {}
        self._generate = self._reward = self._logprobs = self._rollout = self._tokens = 0.0
        self._train = 0.0
        self._step_start = time.perf_counter()

    def rollout_done(self, rollout: Any, seconds: float) -> None:
        """Count a rollout (its generation, reward and log-prob seconds and tokens) towards the next step."""
        self._generate += rollout.generate_seconds
        self._reward += rollout.reward_seconds
        self._logprobs += rollout.logprob_seconds
        self._rollout += seconds  # also old/ref log-probs
        self._tokens += float(rollout.num_tokens)

    def start_cycle(self) -> None:
        """The micro-steps of a cycle begin (the rollout is not part of the step's own time)."""
        self._step_start, self._train = time.perf_counter(), 0.0

    @contextmanager
    def training(self) -> Iterator[None]:
        """Count the block as training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._train += time.perf_counter() - t0

    def step(self, step: int, record: dict[str, float], num_tokens: int) -> None:
        """Add the timing metrics to an optimizer step's ``record``, show it, and write the
        logging window when ``step`` ends one."""
        step_seconds = time.perf_counter() - self._step_start + self._rollout
        record.update(
            {
                "timing/generate": self._generate,
                "timing/reward": self._reward,
                "timing/logprobs": self._logprobs,
                "timing/train": self._train,
                "timing/step": step_seconds,
                "tokens_per_second": self._tokens / max(step_seconds, 1e-9),
                "num_tokens": float(num_tokens),
                "peak_memory_gb": peak_memory_gb(self.device),
            }
        )
        self._generate = self._reward = self._logprobs = self._rollout = self._tokens = 0.0
        self._step_start, self._train = time.perf_counter(), 0.0
        self.window.append(record)
        self.writer.progress(step, record)
        if step % self.logging_steps == 0 or step == self.total_steps:
            self.last_logged = average(self.window)
            self.window = []
            self.writer.log(step, self.last_logged)
            self.history.append({"step": step, **self.last_logged})
