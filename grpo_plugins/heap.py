"""Python's garbage collector during training: keep its full collections short.

A training process holds a large, long-lived Python heap (the model's modules and parameters,
transformers' and torch's own objects, compiled graphs and their guards). Python's full
(generation-2) collection walks every tracked object, so each one costs time proportional to that
heap, and one falls inside some training step now and then: a step-time spike at fixed shapes
that no CUDA or allocator counter explains. ``gc.freeze`` moves the objects alive now into a
permanent generation that collections skip, so a full collection only walks what the run created
since. Collecting first means nothing that is already garbage is kept alive.
"""

from __future__ import annotations

import gc


class LongLivedObjects:
    """Freezes the heap at points where what is alive will stay alive (the engine: after setup,
    and after the first generation cycle has compiled what it compiles), and gives it back to the
    collector at the end."""

    def __init__(self) -> None:
        self.freezes = 0
        self._frozen_by_others = False

    def freeze(self) -> None:
        """Collect what is garbage now, then exempt every live object from later collections."""
        if self.freezes == 0:
            self._frozen_by_others = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        self.freezes += 1

    def release(self) -> None:
        """Return the frozen objects to the collector (a notebook or benchmark process goes on).
        A heap that someone else froze before (a forking server does) stays frozen."""
        if self.freezes and not self._frozen_by_others:
            gc.unfreeze()
        self.freezes = 0
