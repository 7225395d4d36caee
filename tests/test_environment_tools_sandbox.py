"""The ``python`` tool runs a model's program in the code-execution reward's sandbox: programs
that try to escape it (network, host files, fork bombs, endless loops) are checked from outside --
the effect did not happen and nothing is left running -- and each attempt comes back as the tool's
message, never as a crash.

Skipped only where bubblewrap is unusable; with ``CI`` set they fail instead.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sandbox_procs import CLONE_BOMB, sandbox_pids as _sandbox_pids

import builtin_environments.tools as tools
from grpo_plugins.kinds import EnvironmentSettings
from grpo_plugins.testing import ScriptedGenerator, build_tiny_tokenizer, scripted_setup

from builtin_environments import ToolCalling

pytestmark = pytest.mark.usefixtures("bwrap")


@pytest.fixture(autouse=True)
def short_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "PYTHON_TIMEOUT_S", 1.5)


def test_the_python_tool_runs_a_program_and_returns_its_output() -> None:
    assert tools.python("print(1234 * 5678)") == "7006652"
    assert tools.python("x = 1") == "(no output)"
    assert tools.python("print('a'); 1 / 0").startswith("a\n") and "ZeroDivisionError" in tools.python("1 / 0")


def test_no_network(tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    out = tools.python(
        f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
    )
    with pytest.raises(socket.timeout):
        server.accept()  # nothing reached the host's socket
    server.close()
    assert "connected" not in out
    assert "Errno" in out  # the program's own error, as the tool's message


def test_no_host_files_read_or_written(tmp_path: Path) -> None:
    secret = "secret-" + uuid.uuid4().hex
    (tmp_path / "secret.txt").write_text(secret)
    (tmp_path / "secret.txt").chmod(0o644)
    target = tmp_path / "written.txt"
    out = tools.python(
        f"try:\n    print(open({str(tmp_path / 'secret.txt')!r}).read())\nexcept OSError as e:\n    print('read refused', e)\n"
        f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print('write refused', e)\n"
        "open('scratch.txt', 'w').write('only in the private temp dir')\nprint(open('scratch.txt').read())"
    )
    assert secret not in out and not target.exists()
    assert "read refused" in out and "write refused" in out and "only in the private temp dir" in out


def test_a_fork_bomb_is_refused_and_leaves_nothing_running() -> None:
    before = _sandbox_pids()
    start = time.monotonic()
    out = tools.python("import os\nwhile True:\n    os.fork()")
    assert time.monotonic() - start < 5
    assert "Error" in out or "PermissionError" in out or "BlockingIOError" in out
    time.sleep(0.2)
    assert _sandbox_pids() - before == set()


def test_an_endless_loop_is_stopped_at_the_timeout() -> None:
    before = _sandbox_pids()
    start = time.monotonic()
    out = tools.python("while True:\n    pass")
    assert time.monotonic() - start < 4
    assert out.endswith("Error: the program was stopped after 1.5 seconds")
    time.sleep(0.2)
    assert _sandbox_pids() - before == set()


def test_an_escaping_program_is_just_a_tool_message_in_an_episode(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok")))
    call = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    env = ToolCalling(ToolCalling.Params(tools=[], tools_in="template", tool_timeout=10), functions=[tools.python])
    generator = scripted_setup(ScriptedGenerator(lambda p: "gave up" if "<|tool|>" in p else call), tokenizer, 200)
    env.setup(generator, tokenizer, EnvironmentSettings(200, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    prompt = [{"role": "user", "content": "Loop forever."}]
    out = env.run([prompt], env.encode_prompts([prompt], None, "error"), {})
    assert out.completions[0][1]["content"].endswith("stopped after 1.5 seconds")
    assert out.completions[0][2]["content"] == "gave up"
    env.close()


def test_a_thread_bomb_is_a_tool_message_and_a_concurrent_call_still_runs() -> None:
    from builtin_rewards import sandbox

    if sandbox._cgroups() is None and sandbox._run_as() is None and os.geteuid() == 0:
        pytest.skip("no per-run cgroup here and bwrap runs as root: tasks are not bounded")
    outs: dict[str, str] = {}
    bomb = threading.Thread(target=lambda: outs.__setitem__("bomb", tools.python(CLONE_BOMB)))
    bomb.start()
    time.sleep(0.3)
    outs["peer"] = tools.python("print(6 * 7)")
    bomb.join()
    assert outs["peer"] == "42"
    made = int(outs["bomb"].split("made")[1].split()[0])
    assert made < sandbox.SandboxLimits().max_tasks  # with its main thread, max_tasks; and the call returned


def test_a_tool_that_cannot_start_is_an_error_message_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures as cf

    from transformers import AutoTokenizer

    def no_thread(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("can't start new thread")

    import builtin_rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "run_python", no_thread)
    assert tools.python("print(1)") == "Error: the program could not be run (RuntimeError: can't start new thread)"

    tokenizer: Any = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok")))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    env = ToolCalling(ToolCalling.Params(tools=[], tools_in="template", tool_timeout=10), functions=[tools.python])
    generator = scripted_setup(ScriptedGenerator(lambda p: "done" if "<|tool|>" in p else call), tokenizer, 200)
    env.setup(generator, tokenizer, EnvironmentSettings(200, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    monkeypatch.setattr(cf.ThreadPoolExecutor, "submit", no_thread)  # the pool cannot start a worker
    prompt = [{"role": "user", "content": "Run it."}]
    out = env.run([prompt], env.encode_prompts([prompt], None, "error"), {})
    assert out.completions[0][1]["content"] == "Error: tool 'python' could not be started (can't start new thread)"
    assert out.completions[0][2]["content"] == "done"
    env.close()
