"""The static decoder's ``parallel_parts``: a batch decoded as parts at once (branches of one CUDA
graph per step; on a CPU the parts' steps in turn) gives what one batch gives, each part in its
own cache; the loop stops once every part's rows have finished; the settings it cannot be
combined with are refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.generators import static_parts
from grpo_plugins.generators.static_parts import WindowGraphs, decode_windows
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
    assert [key[-1] for key in decoder._graphs] == [2]  # one bucket of two parts, reused by every group


@dataclass
class _State:
    done: torch.Tensor


def _finishing(states: list[_State], finish_at: list[int], log: list[int]) -> WindowGraphs:
    """Graphs over ``states`` that record each replay's cache index; part ``i``'s rows finish
    once cache index ``finish_at[i] - 1`` has been fed."""

    def replay_at(cur: int) -> None:
        log.append(cur)
        for st, at in zip(states, finish_at):
            if cur + 1 >= at:
                st.done.fill_(True)

    graphs = WindowGraphs(states, [1000], [lambda: None])  # type: ignore[arg-type]
    graphs.replay = replay_at  # type: ignore[method-assign]
    return graphs


def test_the_loop_stops_once_every_part_has_finished() -> None:
    log: list[int] = []
    states = [_State(torch.tensor([False, False])), _State(torch.tensor([False]))]
    steps = decode_windows(_finishing(states, [13, 16], log), 10, T=50, check_every=2, stop_at_eos=True)
    # part 0 finished with cache index 12 (the replay at step 3), part 1 with 15 (step 7): the
    # checks at steps 4 and 6 find part 1 still running, the one at step 8 ends the loop
    assert steps == 8 and log == list(range(10, 17))


def test_without_eos_stops_the_loop_runs_to_the_end() -> None:
    log: list[int] = []
    states = [_State(torch.tensor([False])), _State(torch.tensor([False]))]
    assert decode_windows(_finishing(states, [2, 3], log), 0, T=9, check_every=2, stop_at_eos=False) == 9
    assert log == list(range(8))  # T - 1 replays, the first token came from the prefill


class _Stream:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def wait_stream(self, other: "_Stream") -> None:
        self.events.append(f"{self.name} waits for {other.name}")


def test_parts_are_branches_forked_from_the_capturing_stream_and_joined_back(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    current = [_Stream("main", events)]

    @contextlib.contextmanager
    def on(stream: _Stream) -> Iterator[None]:
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(static_parts.torch.cuda, "current_stream", lambda *a: current[-1])
    monkeypatch.setattr(static_parts.torch.cuda, "stream", on)
    steps = [lambda i=i: events.append(f"part {i} on {current[-1].name}") for i in range(3)]
    static_parts._branches(steps, [_Stream("fork1", events), _Stream("fork2", events)])  # type: ignore[list-item]
    assert events == [
        "fork1 waits for main", "part 1 on fork1",
        "fork2 waits for main", "part 2 on fork2",
        "part 0 on main",
        "main waits for fork1", "main waits for fork2",
    ]


def test_sampled_parts_draw_apart_and_a_seed_fixes_them(llama: tuple) -> None:
    model, _ = llama
    sampling = SamplingSettings(max_completion_length=6, temperature=1.0)
    decoder = StaticDecoder(model, sampling, [], 0, parallel_parts=2)
    same = [[1, 5, 6, 7]] * 4
    torch.manual_seed(0)
    first = decoder.generate(same)[0]
    torch.manual_seed(0)
    again = decoder.generate(same)[0]
    assert torch.equal(first, again)
    assert not torch.equal(first[:2], first[2:])  # the two parts' rows did not draw the same numbers


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
