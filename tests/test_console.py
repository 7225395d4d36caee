"""The run's console: phases, every reward component, an ETA, and no third-party noise."""

from __future__ import annotations

import io
import logging

import pytest

from grpo_plugins import console as run_console
from grpo_plugins.console import RunConsole, first_and_last, phase, quiet_libraries

RECORD = {
    "reward": 0.5, "rewards/correct_answer/mean": 0.25, "rewards/format/mean": 1.0,
    "completions/mean_length": 42.0, "timing/step": 40.0,
}


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(run_console.time, "monotonic", fake)
    return fake


def test_without_a_terminal_phases_show_before_the_first_step_and_while_steps_are_slow(clock: Clock) -> None:
    out = io.StringIO()
    with RunConsole(interactive=False, file=out) as shown:
        phase("loading model")
        shown.begin(total_steps=4)
        phase("generating step 1")
        clock.now += 2.0
        shown.step_done(1, RECORD)
        phase("generating step 2")  # 2 s per step: no line per phase
        clock.now += 98.0
        shown.step_done(2, RECORD)
        phase("generating step 3")  # now 50 s per step: each phase is worth a line
    phase("outside the run")  # no run console open: nothing
    assert out.getvalue().splitlines() == [
        "grpo-plugins: loading model...", "grpo-plugins: generating step 1...", "grpo-plugins: generating step 3...",
    ]


def test_the_eta_comes_from_the_mean_step_time_so_far_however_slow(clock: Clock) -> None:
    shown = RunConsole(interactive=False, file=io.StringIO())
    shown.begin(total_steps=45)
    assert shown.eta() == "-:--:--"  # no step yet
    clock.now += 150.0  # two 75 s steps: a progress bar's speed estimate would give up here
    shown.step_done(2, RECORD)
    assert shown.eta() == "0:53:45"  # 43 steps x 75 s
    assert shown.line(2, RECORD) == (
        "step 2/45 | reward 0.500 | correct_answer 0.250 format 1.000 | len 42.0 | 40.00 s/step | ETA 0:53:45"
    )


def test_a_resumed_run_times_only_its_own_steps(clock: Clock) -> None:
    shown = RunConsole(interactive=False, file=io.StringIO())
    shown.begin(total_steps=10, start_step=6)
    clock.now += 10.0
    shown.step_done(8, RECORD)
    assert shown.seconds_per_step() == 5.0 and shown.eta() == "0:00:10"


def test_in_a_terminal_the_display_shows_the_phase_every_component_and_the_length(clock: Clock) -> None:
    from rich.console import Console

    with RunConsole(interactive=True) as shown:
        shown._progress.stop()  # rendered by hand below, not by the live thread
        shown.begin(total_steps=45)
        clock.now += 20.0
        shown.step_done(1, RECORD | {"kl": 0.0012})
        phase("scoring step 2")
        clock.now += 3.0
        screen = Console(file=io.StringIO(), width=200, record=True)
        for renderable in shown._progress.get_renderables():
            screen.print(renderable)
        text = screen.export_text()
    # 44 steps x 20 s, 3 s of the current one gone
    assert "1/45" in text and "20.0 s/step" in text and "ETA 0:14:37" in text and "scoring step 2 (3 s)" in text
    assert "reward 0.500 | correct_answer 0.250 format 1.000 | kl 0.0012 | len 42.0" in text


def test_first_and_last_are_the_means_of_the_first_and_last_quarter() -> None:
    records = [{"step": s, "reward": float(s)} for s in range(1, 9)]  # quarters: steps 1-2 and 7-8
    assert first_and_last(records, "reward") == (1.5, 7.5)
    assert first_and_last(records[:3], "reward") == (1.0, 3.0)  # at least one record each
    assert first_and_last(records, "kl") is None


def test_library_progress_bars_and_known_noise_are_off_inside_and_restored_after(caplog: pytest.LogCaptureFixture) -> None:
    import datasets.utils.logging as ds_logging
    import transformers.utils.logging as tf_logging

    caplog.set_level(logging.WARNING)
    noisy = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert tf_logging.is_progress_bar_enabled() and ds_logging.is_progress_bar_enabled()
    with quiet_libraries():
        assert not tf_logging.is_progress_bar_enabled() and not ds_logging.is_progress_bar_enabled()
        noisy.warning("Failed to load CPU gemm_4bit_forward from kernels-community: no kernels. Please ... `pip install kernels`")
        noisy.warning("another bitsandbytes warning")
    assert tf_logging.is_progress_bar_enabled() and ds_logging.is_progress_bar_enabled()
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
    assert noisy.filters == []


def test_show_library_output_lets_everything_through() -> None:
    import transformers.utils.logging as tf_logging

    run_console.show_library_output(True)
    try:
        with quiet_libraries():
            assert tf_logging.is_progress_bar_enabled()
    finally:
        run_console.show_library_output(False)


def test_the_first_step_says_it_compiles_when_it_does() -> None:
    out = io.StringIO()
    with RunConsole(interactive=False, file=out) as shown:
        shown.compiling = True
        shown.begin(total_steps=3)
        phase("generating step 1")
        shown.step_done(1, RECORD)
        shown.step_done(2, RECORD)
    assert out.getvalue().splitlines() == ["grpo-plugins: generating step 1 (compiling first)..."]
