"""A batch decoded as parts: one after another (``max_batch_rows``) or at once
(``parallel_parts``), and what the static decoder keeps per part: its window graphs (captured
by :func:`capture_windows`) and its random state.

At 64 rows a small model's decode step is mostly fixed per-kernel costs (launch, ramp, tail),
so the GPU idles inside every step. Parts decoded at once replay their CUDA graphs on streams
of their own, and one part's kernels run in the gaps of another's; each part reads the weights
once per step, so the weight traffic grows with the parts. Each part has its own graphs, KV
cache and memory pool, and its graphs draw their random numbers from a random state of their
own (:class:`PartRandomStates`): graphs replayed at once on one state would race on its offset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from grpo_plugins.generators.static_steps import DecodeState


@dataclass
class WindowGraphs:
    """The decode steps of one (batch, prompt, completion) bucket: one replay per attention
    window, ascending, all over the same :class:`DecodeState`."""

    state: DecodeState
    windows: list[int]
    replays: list[Callable[[], None]]

    def replay(self, cur: int) -> None:
        """One decode step feeding cache index ``cur``: the smallest window that holds it."""
        for window, replay in zip(self.windows, self.replays):
            if cur < window:
                replay()
                return
        raise AssertionError(f"cache index {cur} beyond the last window {self.windows[-1]}")


def capture_windows(st: DecodeState, steps: list[Callable[[], None]], device: torch.device) -> list[Callable[[], None]]:
    """Capture each of ``steps`` (one per attention window) in a CUDA graph; the graphs share
    one memory pool, as they never run at the same time and keep nothing between replays."""
    # Warm up (and compile) on a side stream, then capture. The counters the warm-ups
    # advance are reset by every generate() before the first replay.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in steps:
            for _ in range(3):
                st.cur.zero_()
                st.step.zero_()
                step()
    torch.cuda.current_stream(device).wait_stream(side)
    graphs: list[torch.cuda.CUDAGraph] = []
    for step in steps:
        st.cur.zero_()
        st.step.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
            step()
        graphs.append(graph)
    return [g.replay for g in graphs]


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


class PartRandomStates:
    """A random state per part for the graphs of parts decoded at once.

    A captured graph draws from the generator state that was current at capture and advances
    it at each replay; parts on one state, replayed at once on several streams, would each
    overwrite the offset the others' kernels are about to read. Here part ``i``'s graphs are
    captured with state ``i`` current (:meth:`capturing`), and :meth:`reseed` draws every
    state's seed from torch's CPU generator before each generation, so a run's seed (and a
    resumed run's restored generators) fixes the samples.
    """

    def __init__(self) -> None:
        self._states: dict[tuple[torch.device, int], torch.Generator] = {}

    @staticmethod
    def _default(device: torch.device) -> torch.Generator:
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]

    @contextlib.contextmanager
    def capturing(self, device: torch.device, part: int) -> Iterator[None]:
        """Inside the block part ``part``'s state is the device's current random state."""
        default = self._default(device)
        state = self._states.get((device, part))
        if state is None:
            state = self._states[(device, part)] = default.clone_state()
        saved = default.graphsafe_get_state()
        default.graphsafe_set_state(state)
        try:
            yield
        finally:
            default.graphsafe_set_state(saved)

    def reseed(self, device: torch.device, parts: int) -> None:
        """New seeds for parts ``0 .. parts - 1``, drawn from torch's CPU generator."""
        seeds = torch.randint(0, 2**62, (parts,)).tolist()
        for part, seed in enumerate(seeds):
            state = self._states.get((device, part))
            if state is not None:
                state.manual_seed(seed)


def decode_together(
    graphs: list[WindowGraphs], first_cache_index: list[int], T: int, streams: list[torch.cuda.Stream] | None,
    check_every: int, stop_at_eos: bool,
) -> int:
    """Replay the parts' decode steps in turn, each part on its own stream (None: the current
    one, as on a CPU), until ``T`` tokens; with ``stop_at_eos``, every ``check_every`` steps
    (one host sync) a part whose rows have all finished stops, and all stop when every part
    has. Returns the steps taken (the first token, sampled at the prefill, included)."""
    main = torch.cuda.current_stream() if streams is not None else None
    lanes = list(zip(graphs, first_cache_index, streams if streams is not None else [None] * len(graphs)))
    for _, _, stream in lanes:
        if stream is not None:
            stream.wait_stream(main)
    steps = 1
    while steps < T:
        if stop_at_eos and steps % check_every == 0:
            for _, _, stream in lanes:
                if stream is not None:
                    main.wait_stream(stream)
            finished = torch.stack([g.state.done.all() for g, _, _ in lanes]).tolist()
            lanes = [lane for lane, done in zip(lanes, finished) if not done]
            if not lanes:
                break
        for graph, start, stream in lanes:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                graph.replay(start + steps - 1)  # feeds the token sampled last
        steps += 1
    for _, _, stream in lanes:
        if stream is not None:
            main.wait_stream(stream)
    return steps
