"""A batch decoded as parts: one after another (``max_batch_rows``) or at once
(``parallel_parts``), and the graphs the static decoder keeps per bucket (captured by
:func:`capture_windows`).

At 64 rows a small model's decode step is mostly fixed per-kernel costs (launch, ramp, tail),
so the GPU idles inside every step. Parts decoded at once are captured as parallel branches of
one CUDA graph per step: part 0 on the capturing stream, each other part on a stream forked from
it and joined back, so one part's kernels run in the gaps of another's. Each part has its own KV
cache (a :class:`DecodeState`) and reads the weights once per step, so the weight traffic grows
with the parts. The random numbers need nothing of their own: every random kernel of a captured
graph gets its own offset into the generator's stream at capture, whichever branch it is on, so
branches running at once draw distinct numbers and a run's seed fixes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_plugins.generators.static_steps import DecodeState


@dataclass
class WindowGraphs:
    """The decode steps of one (batch, prompt, completion, parts) bucket: one replay per
    attention window, ascending; a replay steps every part's state once."""

    states: list[DecodeState]
    windows: list[int]
    replays: list[Callable[[], None]]

    def replay(self, cur: int) -> None:
        """One decode step feeding cache index ``cur``: the smallest window that holds it."""
        for window, replay in zip(self.windows, self.replays):
            if cur < window:
                replay()
                return
        raise AssertionError(f"cache index {cur} beyond the last window {self.windows[-1]}")


def in_turn(steps: list[Callable[[], None]]) -> Callable[[], None]:
    """One step of every part, one after another on the current stream (no graph: a CPU)."""

    def step() -> None:
        for part_step in steps:
            part_step()

    return step


def _branches(steps: list[Callable[[], None]], streams: list[torch.cuda.Stream]) -> None:
    """Part 0's step on the current stream, part ``i``'s on ``streams[i - 1]``, forked from the
    current stream and joined back to it (inside a capture: parallel branches of the graph)."""
    main = torch.cuda.current_stream()
    for stream, step in zip(streams, steps[1:]):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            step()
    steps[0]()
    for stream in streams:
        main.wait_stream(stream)


def capture_windows(
    states: list[DecodeState], steps: list[list[Callable[[], None]]], device: torch.device
) -> list[Callable[[], None]]:
    """Capture one CUDA graph per attention window; ``steps[w][i]`` is part ``i``'s step in
    window ``w`` (over ``states[i]``). With several parts a graph holds them as parallel
    branches. The graphs share one memory pool, as they never run at the same time and keep
    nothing between replays."""

    def reset() -> None:
        for st in states:
            st.cur.zero_()
            st.step.zero_()

    # Warm up (and compile) on a side stream, then capture. The counters the warm-ups
    # advance are reset by every generate() before the first replay.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for window_steps in steps:
            for _ in range(3):
                reset()
                in_turn(window_steps)()
    torch.cuda.current_stream(device).wait_stream(side)
    forks = [torch.cuda.Stream(device) for _ in states[1:]]
    graphs: list[torch.cuda.CUDAGraph] = []
    for window_steps in steps:
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
            _branches(window_steps, forks)
        graphs.append(graph)
    return [g.replay for g in graphs]


def decode_windows(graphs: WindowGraphs, first_cache_index: int, T: int, check_every: int, stop_at_eos: bool) -> int:
    """Replay the decode steps until ``T`` tokens; with ``stop_at_eos``, every ``check_every``
    steps (one host sync) stop once every row of every part has finished. Returns the steps
    taken (the first token, sampled at the prefill, included)."""
    steps = 1
    while steps < T:
        if stop_at_eos and steps % check_every == 0 and bool(torch.stack([st.done.all() for st in graphs.states]).all()):
            break
        graphs.replay(first_cache_index + steps - 1)  # feeds the token sampled last
        steps += 1
    return steps


def join_parts(parts: list[tuple[torch.Tensor, ...]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Stack the outputs of a batch's parts: completion ids, mask, truncation flags and
    log-probs, right-padded to the longest completion."""
    if len(parts) == 1:
        return parts[0]
    width = max(p[0].shape[1] for p in parts)

    def widen(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return (
        torch.cat([widen(p[0], pad_id) for p in parts]),  # (n, T)
        torch.cat([widen(p[1], 0) for p in parts]),  # (n, T)
        torch.cat([p[2] for p in parts]),  # (n,)
        torch.cat([widen(p[3], 0.0) for p in parts]),  # (n, T)
    )
