"""Loss metrics kept as sums, counts and extrema, so that micro-batches, row chunks and processes
merge exactly (:class:`LossMetrics`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["LossMetrics"]


class LossMetrics(Mapping[str, float]):
    """Metrics of one or more micro-batches, mergeable exactly.

    Mean-type metrics are kept as ``sums`` and ``counts`` (1-D tensors aligned with
    ``mean_names``); extrema as ``mins`` / ``maxs`` (aligned with ``min_names`` / ``max_names``,
    +inf / -inf when nothing was seen). Read as a mapping name -> float: ``sum / max(count, 1)``,
    and an extremum that saw nothing reads 0.0, so no value is ever NaN or inf. Values are
    computed on first access (one device sync).

    Across processes a mean pools every process's sums and counts, except the names in
    ``process_means``: those are the mean of each process's own mean (a process that saw
    nothing counts as 0), which is how TRL averages its sampler metrics over processes.
    """

    def __init__(
        self,
        mean_names: Iterable[str],
        sums: Tensor,
        counts: Tensor,
        min_names: Iterable[str] = (),
        mins: Tensor | None = None,
        max_names: Iterable[str] = (),
        maxs: Tensor | None = None,
        process_means: Iterable[str] = (),
    ) -> None:
        self.mean_names = tuple(mean_names)
        self.process_means = frozenset(process_means)
        self.min_names = tuple(min_names)
        self.max_names = tuple(max_names)
        self.sums, self.counts = sums, counts  # (M,) (M,)
        empty = sums.new_zeros(0)
        self.mins = mins if mins is not None else empty  # (E_min,)
        self.maxs = maxs if maxs is not None else empty  # (E_max,)
        self._values: dict[str, float] | None = None

    @classmethod
    def from_parts(
        cls,
        means: Mapping[str, tuple[Tensor, Tensor]],
        mins: Mapping[str, Tensor] | None = None,
        maxs: Mapping[str, Tensor] | None = None,
        *,
        process_means: Iterable[str] = (),
        device: torch.device | None = None,
    ) -> LossMetrics:
        """From ``{name: (sum, count)}`` and ``{name: min}`` / ``{name: max}`` 0-d tensors."""
        mins, maxs = mins or {}, maxs or {}

        def stack(values: Iterable[Tensor]) -> Tensor:
            values = [v.detach().float().reshape(()) for v in values]
            return torch.stack(values) if values else torch.zeros(0, device=device)

        return cls(
            means,
            stack(s for s, _ in means.values()),
            stack(c for _, c in means.values()),
            mins,
            stack(mins.values()),
            maxs,
            stack(maxs.values()),
            process_means,
        )

    def _compute(self) -> dict[str, float]:
        if self._values is None:
            means = (self.sums / self.counts.clamp(min=1.0)).tolist()
            mins = [v if abs(v) != float("inf") else 0.0 for v in self.mins.tolist()]
            maxs = [v if abs(v) != float("inf") else 0.0 for v in self.maxs.tolist()]
            self._values = {
                **dict(zip(self.mean_names, means)),
                **dict(zip(self.min_names, mins)),
                **dict(zip(self.max_names, maxs)),
            }
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._compute()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._compute())

    def __len__(self) -> int:
        return len(self.mean_names) + len(self.min_names) + len(self.max_names)

    def __repr__(self) -> str:
        return f"LossMetrics({self._compute()!r})"

    @classmethod
    def merge(cls, items: Iterable[LossMetrics]) -> LossMetrics:
        """Combine micro-batches exactly: sums and counts add, extrema take min / max. Names
        missing from some items count as nothing seen there."""
        items = list(items)
        if not items:
            raise ValueError("LossMetrics.merge needs at least one LossMetrics")
        means: dict[str, tuple[Tensor, Tensor]] = {}
        mins: dict[str, Tensor] = {}
        maxs: dict[str, Tensor] = {}
        process_means: set[str] = set()
        for item in items:
            process_means |= item.process_means
            for i, name in enumerate(item.mean_names):
                s, c = item.sums[i], item.counts[i]
                if name in means:
                    s, c = means[name][0] + s, means[name][1] + c
                means[name] = (s, c)
            for i, name in enumerate(item.min_names):
                mins[name] = torch.minimum(mins[name], item.mins[i]) if name in mins else item.mins[i]
            for i, name in enumerate(item.max_names):
                maxs[name] = torch.maximum(maxs[name], item.maxs[i]) if name in maxs else item.maxs[i]
        return cls.from_parts(means, mins, maxs, process_means=process_means, device=items[0].sums.device)

    def all_reduce(self, accelerator: Any) -> LossMetrics:
        """The same metrics over all processes of an ``accelerate.Accelerator`` (every process
        must call this, with the same metric names)."""
        if getattr(accelerator, "num_processes", 1) <= 1:
            return self
        sums, counts = self.sums, self.counts
        if self.process_means:
            own = torch.zeros(len(self.mean_names), dtype=torch.bool, device=sums.device)
            for i, name in enumerate(self.mean_names):  # set on the device: no copy from the host
                if name in self.process_means:
                    own[i] = True
            sums = torch.where(own, sums / counts.clamp(min=1.0), sums)  # this process's mean ...
            counts = torch.where(own, torch.ones_like(counts), counts)  # ... counted once
        sums = accelerator.reduce(sums.contiguous(), reduction="sum")
        counts = accelerator.reduce(counts.contiguous(), reduction="sum")
        mins = accelerator.gather(self.mins.unsqueeze(0).contiguous()).amin(0) if len(self.mins) else self.mins
        maxs = accelerator.gather(self.maxs.unsqueeze(0).contiguous()).amax(0) if len(self.maxs) else self.maxs
        return LossMetrics(
            self.mean_names, sums, counts, self.min_names, mins, self.max_names, maxs, self.process_means
        )
