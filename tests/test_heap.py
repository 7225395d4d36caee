"""Python's garbage collector during training (grpo_plugins/heap.py): the engine freezes the
long-lived heap so that full collections inside the steps do not walk the model's objects."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from grpo_plugins.engine import Engine
from grpo_plugins.heap import LongLivedObjects
from grpo_plugins.models import load_model
from grpo_plugins.rewards import RewardError


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def _tracked_ids() -> set[int]:
    return {id(obj) for obj in gc.get_objects()}  # the permanent generation is not listed


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freeze_collects_garbage_first_and_exempts_what_is_alive() -> None:
    garbage, live = Node(), Node()
    garbage.other, garbage.other.other = Node(), garbage  # a cycle, unreachable below
    dead = weakref.ref(garbage)
    del garbage
    heap = LongLivedObjects()
    heap.freeze()
    assert dead() is None  # collected before freezing, not kept alive for the whole run
    assert gc.get_freeze_count() > 0 and id(live) not in _tracked_ids()
    heap.release()
    assert gc.get_freeze_count() == 0 and id(live) in _tracked_ids()


def test_a_heap_frozen_by_someone_else_stays_frozen() -> None:
    gc.freeze()  # e.g. a server that forks its workers
    before = gc.get_freeze_count()
    heap = LongLivedObjects()
    heap.freeze()
    heap.release()
    assert gc.get_freeze_count() >= before


def _config(tiny_model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 6,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 2,
        "num_generations": 4, "max_completion_length": 4, "report_to": [], "save_steps": 100, "seed": 0,
        **overrides,
    }


def test_training_freezes_the_model_after_setup_and_the_first_cycle_then_releases(
    tiny_model: dict, tmp_path: Path
) -> None:
    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    weight = next(model.parameters())
    seen: list[tuple[int, bool]] = []  # per rollout: frozen objects, is the weight still walked

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.append((gc.get_freeze_count(), id(weight) in _tracked_ids()))
        return [float(len(c)) for c in completions]

    Engine(_config(tiny_model, tmp_path), model=model, tokenizer=tokenizer, rewards=[reward],
           dataset=[{"prompt": p} for p in "abcdefgh"]).train()
    assert len(seen) == 3  # 6 steps, 2 per rollout
    assert all(count > 0 and not walked for count, walked in seen)
    assert seen[1][0] > seen[0][0]  # the first cycle's long-lived objects were frozen too
    assert seen[2][0] <= seen[1][0]  # and nothing after that (frozen objects still die by refcount)
    assert gc.get_freeze_count() == 0 and id(weight) in _tracked_ids()


def test_a_failed_run_gives_the_heap_back(tiny_model: dict, tmp_path: Path) -> None:
    def failing(completions: list[Any], **kwargs: Any) -> list[float]:
        assert gc.get_freeze_count() > 0
        raise ValueError("boom")

    with pytest.raises(RewardError):
        Engine(_config(tiny_model, tmp_path), rewards=[failing], dataset=[{"prompt": p} for p in "abcd"]).train()
    assert gc.get_freeze_count() == 0
