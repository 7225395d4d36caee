"""An installed plugin that the config does not use cannot change a seeded run: whatever its
import or registration hook does to the random number generators or torch's thread count is
undone when it has loaded."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from grpo_plugins.engine import Engine
from grpo_plugins.metrics import read_metrics
from grpo_plugins.registry import Registry
from grpo_plugins.testing import isolated_registry
from plugin_dists import make_distribution

#: A plugin that draws from every generator and changes torch's thread count at import and in
#: its registration hook, and registers a reward nobody uses.
NOISY = """
import random
import numpy
import torch
from grpo_plugins import hookimpl

random.random(); numpy.random.rand(5); torch.rand(100)
torch.set_num_threads(torch.get_num_threads() + 1)

def unused(prompts, completions, **kwargs):
    '''Never named by a config.'''
    return [0.0] * len(completions)

@hookimpl
def register_rewards(register):
    random.random(); numpy.random.rand(5); torch.rand(100)
    register(unused, name="noisy_unused")
"""

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that almost surely differs within a group."""
    return [float(sum(map(ord, c if isinstance(c, str) else c[0]["content"])) % 7) for c in completions]


@pytest.fixture
def noisy_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A path entry holding the noisy plugin's distribution (not yet on sys.path)."""
    for var in ("GRPO_PLUGINS_STRICT", "GRPO_PLUGINS_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "noisy_plugin_mod", raising=False)
    threads = torch.get_num_threads()
    yield make_distribution(tmp_path / "site", "noisy-plugin", "1.0", {"noisy_plugin_mod": NOISY})
    torch.set_num_threads(threads)


def _draws_after_loading(registry: Registry) -> tuple[list[float], float, list[float], int]:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    registry.names("reward")  # discovery: imports the plugins and calls their hooks
    return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist(), torch.get_num_threads()


def test_loading_a_plugin_leaves_the_random_generators_and_threads_as_they_were(
    noisy_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without = _draws_after_loading(Registry())
    monkeypatch.syspath_prepend(str(noisy_site))
    registry = Registry()
    with_noisy = _draws_after_loading(registry)
    assert "noisy_unused" in registry.names("reward"), registry.broken
    assert with_noisy == without


def _seeded_run(tiny_model: dict, out: Path) -> list[dict[str, Any]]:
    cfg = {
        "model": tiny_model, "task": None, "output_dir": str(out), "max_steps": 3, "seed": 7,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "num_generations": 4,
        "max_completion_length": 6, "learning_rate": 1e-2, "report_to": ["jsonl"],
    }
    Engine(cfg, rewards=[char_sum], dataset=PROMPTS).train()
    return [
        {k: v for k, v in r.items() if not k.startswith(("timing/", "tokens_per_second", "peak_memory"))}
        for r in read_metrics(out)
    ]


def test_a_seeded_run_is_the_same_with_or_without_an_unrelated_plugin_installed(
    tiny_model: dict, tmp_path: Path, noisy_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with isolated_registry(entry_points=True):
        plain = _seeded_run(tiny_model, tmp_path / "plain")
    monkeypatch.syspath_prepend(str(noisy_site))
    with isolated_registry(entry_points=True) as registry:
        noisy = _seeded_run(tiny_model, tmp_path / "noisy")
        assert "noisy_unused" in registry.names("reward"), registry.broken
    assert len(plain) == 3
    assert noisy == plain
