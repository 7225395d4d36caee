"""The static decoder's ``parallel_parts``: a batch decoded as parts at once (on a CPU their steps
interleaved on one stream) gives what one batch gives, each part in its own cache; a part whose
rows have all finished stops replaying; the settings it cannot be combined with are refused."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.generators.static_parts import decode_together
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 40], [1, 3, 4], [1, 22, 23, 24]]


@pytest.fixture(scope="module")
def llama(tiny_model: dict) -> tuple:
    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    return model.eval(), tokenizer


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_parts_at_once_decode_what_one_batch_decodes(llama: tuple, request: pytest.FixtureRequest, parts: int) -> None:
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=8, top_k=1)
    first = StaticDecoder(model, greedy, [2], 0).generate(PROMPTS)[0]
    eos = [int(first[1, 0]), int(first[4, 2])]  # rows stop at different steps
    whole = StaticDecoder(model, greedy, eos, 0, check_every=2).generate(PROMPTS)
    allocated_rows = request.getfixturevalue("cache_rows")
    together = StaticDecoder(model, greedy, eos, 0, check_every=2, parallel_parts=parts).generate(PROMPTS)
    assert len(set(whole[1].sum(1).tolist())) > 1  # completions of different lengths
    for a, b in zip(whole[:3], together[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(whole[3], together[3], atol=1e-5, rtol=1e-5)
    rows = -(-len(PROMPTS) // parts)
    assert allocated_rows == [rows] * -(-len(PROMPTS) // rows)  # a cache per part


def test_parts_at_once_with_a_row_limit_go_in_groups(llama: tuple) -> None:
    """max_batch_rows 1 with two parts at once: six parts of one row, decoded two at a time."""
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=5, top_k=1)
    whole = StaticDecoder(model, greedy, [2], 0).generate(PROMPTS)
    decoder = StaticDecoder(model, greedy, [2], 0, parallel_parts=2, max_batch_rows=1)
    together = decoder.generate(PROMPTS)
    assert torch.equal(whole[0], together[0])
    assert sorted({key[-1] for key in decoder._graphs}) == [0, 1]  # two parts' graphs, reused by every group


@dataclass
class _State:
    done: torch.Tensor


@dataclass
class _Part:
    """A stand-in for a part's graphs: records the cache index of each replay; its rows finish
    at ``finish_at``."""

    name: str
    finish_at: int
    log: list[tuple[str, int]]
    state: _State = field(default_factory=lambda: _State(torch.tensor([False, False])))

    def replay(self, cur: int) -> None:
        self.log.append((self.name, cur))
        if cur + 1 >= self.finish_at:
            self.state.done.fill_(True)


def test_parts_take_turns_and_a_finished_part_stops() -> None:
    log: list[tuple[str, int]] = []
    early, late = _Part("early", 13, log), _Part("late", 100, log)
    steps = decode_together([early, late], [10, 20], T=9, streams=None, check_every=2, stop_at_eos=True)  # type: ignore[list-item]
    assert steps == 9
    assert log[:4] == [("early", 10), ("late", 20), ("early", 11), ("late", 21)]  # in turn, each from its own start
    assert [cur for name, cur in log if name == "early"] == [10, 11, 12]  # done at cache index 12, seen at step 4's check
    assert [cur for name, cur in log if name == "late"] == list(range(20, 28))  # T - 1 replays


def test_all_parts_finished_ends_the_loop() -> None:
    log: list[tuple[str, int]] = []
    parts = [_Part("a", 3, log), _Part("b", 2, log)]
    assert decode_together(parts, [0, 0], T=50, streams=None, check_every=4, stop_at_eos=True) == 4  # type: ignore[arg-type]
    assert len(log) == 6
    log.clear()
    parts = [_Part("a", 3, log), _Part("b", 2, log)]
    assert decode_together(parts, [0, 0], T=50, streams=None, check_every=4, stop_at_eos=False) == 50  # type: ignore[arg-type]


def test_settings_parallel_parts_cannot_take(llama: tuple) -> None:
    model, _ = llama
    sampling = SamplingSettings(max_completion_length=4)
    with pytest.raises(GRPOPluginsError, match="parallel_parts must be at least 1"):
        StaticDecoder(model, sampling, [2], 0, parallel_parts=0)
    with pytest.raises(GRPOPluginsError, match="persistent_layers needs the whole GPU"):
        StaticDecoder(model, sampling, [2], 0, parallel_parts=2, persistent_layers=True)
    assert StaticDecoder(model, sampling, [2], 0, parallel_parts=2, persistent_layers=None).persistent_layers is False


def test_the_static_generator_passes_the_setting_on(llama: tuple) -> None:
    from grpo_plugins.registry import get_registry

    component = get_registry().get("generator", "static")
    params = component.validate_params({"parallel_parts": 3})
    assert params.parallel_parts == 3
    with pytest.raises(Exception, match="parallel_parts"):
        component.validate_params({"parallel_parts": 0})


class _FakeState:
    def __init__(self, name: str) -> None:
        self.name, self.seed = name, None

    def manual_seed(self, seed: int) -> None:
        self.seed = seed


class _FakeGenerator:
    """The graph-safe state calls of a CUDA generator (a CPU generator has none of them)."""

    def __init__(self) -> None:
        self.current = _FakeState("default")
        self.clones = 0

    def clone_state(self) -> _FakeState:
        self.clones += 1
        return _FakeState(f"clone{self.clones}")

    def graphsafe_get_state(self) -> _FakeState:
        return self.current

    def graphsafe_set_state(self, state: _FakeState) -> None:
        self.current = state


def test_each_part_captures_with_its_own_state_reseeded_from_the_cpu_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_plugins.generators.static_parts import PartRandomStates

    gen = _FakeGenerator()
    monkeypatch.setattr(PartRandomStates, "_default", staticmethod(lambda device: gen))
    states, device = PartRandomStates(), torch.device("cuda", 0)
    seen = []
    for part in (0, 1, 0):
        with states.capturing(device, part):
            seen.append(gen.current.name)
        assert gen.current.name == "default"  # restored after the capture
    assert seen == ["clone1", "clone2", "clone1"] and gen.clones == 2  # one state per part, kept
    with pytest.raises(RuntimeError), states.capturing(device, 1):
        raise RuntimeError("capture failed")
    assert gen.current.name == "default"  # restored on an error too
    torch.manual_seed(3)
    states.reseed(device, 2)
    first = [states._states[(device, p)].seed for p in (0, 1)]
    torch.manual_seed(3)
    states.reseed(device, 2)
    assert first == [states._states[(device, p)].seed for p in (0, 1)]  # the run's seed fixes them
    assert first[0] != first[1]
