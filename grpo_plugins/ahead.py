"""Generating the next batch while this one trains (``generate_ahead``).

After a cycle's rollout is made, :class:`AheadGeneration` starts the next cycle's generation in a
thread of its own (on a CUDA stream of its own, of high priority) and the training thread goes on
with the micro-steps; the engine waits for it before the cycle's first optimizer step, so the
generation reads weights that nothing changes while it runs. The next cycle then scores and
trains on completions sampled by the policy one optimizer step older than the one it trains,
the gap the rollout correction weighs back. It pays where the generator decodes on GPUs of its
own (the vllm generator's server mode): there the two overlap fully. On the training's own GPU
the decode hardly advances while the training pass's kernels hold the multiprocessors (measured:
0.5B, 2.07 against 2.10 s a step), whatever the stream priority.

The environment readies the call in the training thread (:meth:`Environment.run_beside`:
compiling and capturing, taking the generation's seed there); where it cannot, the next batch
is generated right away in the training thread, before the micro-steps: the same samples, no
overlap. The pending generation is part of a checkpoint, so a resumed run trains on the very
completions the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from grpo_plugins.kinds import Episodes

logger = logging.getLogger(__name__)

__all__ = ["AheadGeneration", "Pending"]


@dataclass
class Pending:
    """The next cycle's generation: its prompts (``indices`` into the prompt stream, the first
    ``first_prompt``) and, once finished, its episodes and the seconds it took."""

    first_prompt: int
    indices: list[int]
    episodes: Episodes | None = None
    seconds: float = 0.0
    future: Future[tuple[Episodes, float]] | None = None


class AheadGeneration:
    """Runs one generation at a time beside the training pass (see the module docstring)."""

    def __init__(self, environment: Any, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread sets it as its own
            device = torch.device("cuda", torch.cuda.current_device())
        self.environment, self.device = environment, device
        self.pending: Pending | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._warned = False

    def start(self, first_prompt: int, indices: list[int], prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]) -> None:
        """Start generating episodes for ``prompts`` (this process's rows of the cycle whose
        prompt stream starts at ``first_prompt``)."""
        self.pending = Pending(first_prompt, list(indices))
        call = self.environment.run_beside(prompts, prompt_ids, columns)
        if call is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "generate_ahead: environment %r with generator %r cannot generate beside the training pass; "
                    "the next batch is generated before this one trains (the same samples, no overlap)",
                    type(self.environment).__name__, type(getattr(self.environment, "generator", None)).__name__,
                )
            t0 = time.perf_counter()
            with torch.no_grad():
                self.pending.episodes = self.environment.run(prompts, prompt_ids, columns)
            self.pending.seconds = time.perf_counter() - t0
            return
        stream = self._side_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # e.g. the merged copies' inputs
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-ahead")
        self.pending.future = self._pool.submit(self._run, call, stream)

    def _side_stream(self) -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device, priority=-1)  # the decode's short kernels first
        return self._stream

    def _run(self, call: Callable[[], Episodes], stream: torch.cuda.Stream | None) -> tuple[Episodes, float]:
        t0 = time.perf_counter()
        if stream is None:
            with torch.no_grad():
                return call(), time.perf_counter() - t0
        torch.cuda.set_device(self.device)  # the thread's own current device
        with torch.no_grad(), torch.cuda.stream(stream):
            episodes = call()
        stream.synchronize()
        return episodes, time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the pending generation (if any) finished; its errors are raised here."""
        pending = self.pending
        if pending is None or pending.future is None:
            return
        future, pending.future = pending.future, None
        pending.episodes, pending.seconds = future.result()
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def take(self, indices: list[int]) -> Pending | None:
        """The finished generation for exactly these prompt rows, or None (then generate them
        now). It stays pending (and in checkpoints) until :meth:`done`."""
        if self.pending is None or self.pending.indices != list(indices):
            return None
        self.wait()
        return self.pending

    def done(self) -> None:
        """The pending generation was used."""
        self.wait()
        self.pending = None

    def covers(self, first_prompt: int) -> bool:
        """Whether the cycle starting at ``first_prompt`` is pending already (after a resume)."""
        return self.pending is not None and self.pending.first_prompt == first_prompt

    def state(self) -> dict[str, Any] | None:
        """The pending generation for a checkpoint (finished first), or None."""
        self.wait()
        if self.pending is None:
            return None
        p = self.pending
        return {"first_prompt": p.first_prompt, "indices": p.indices, "episodes": p.episodes, "seconds": p.seconds}

    def load(self, state: dict[str, Any] | None) -> None:
        """Restore a checkpoint's pending generation (tensors onto this run's device)."""
        if state is None:
            self.pending = None
            return
        episodes = state["episodes"]
        for name in ("completion_ids", "completion_mask", "model_mask", "is_truncated", "sampling_logps"):
            value = getattr(episodes, name)
            if value is not None:
                setattr(episodes, name, value.to(self.device))
        self.pending = Pending(int(state["first_prompt"]), list(state["indices"]), episodes, float(state["seconds"]))

    def close(self) -> None:
        """Wait for a generation still running (its result unused) and stop the thread."""
        with contextlib.suppress(Exception):
            self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
