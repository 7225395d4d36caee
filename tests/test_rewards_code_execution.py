"""The code-execution reward and its sandbox: scores, test formats, limits, and the bubblewrap requirement.

The hostile programs are in test_sandbox_attacks.py."""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import pytest

from builtin_rewards import sandbox
from builtin_rewards.code_execution import CodeExecution, extract_code
from builtin_rewards.sandbox import SandboxLimits, SandboxUnavailable, run_function_test, run_python

FAST = SandboxLimits(timeout=1.0, cpu_seconds=1, memory_mb=256)


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A world-writable directory outside the sandbox: only the sandbox itself can stop a write."""
    target = tmp_path / "outside"
    target.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(target, 0o777)
    return target


def reward(**params) -> CodeExecution:
    return CodeExecution(CodeExecution.Params(**{"timeout": 1.0, "cpu_seconds": 1, **params}))


def test_stdin_stdout_tests_score_the_fraction_passed(bwrap):
    tests = [[{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "0 0", "output": "1"}]] * 2
    completions = [
        "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```",
        "```python\nprint(0)\n```",
    ]
    assert reward()(["q", "q"], completions, tests=tests) == pytest.approx([2 / 3, 0.0])


def test_assert_tests_and_json_string_column(bwrap):
    tests = ['["assert square(3) == 9", "assert square(-2) == 4"]'] * 2
    completions = ["def square(x):\n    return x * x", [{"role": "assistant", "content": "def square(x): return x + x"}]]
    assert reward()(["q", "q"], completions, tests=tests) == [1.0, 0.0]
    assert reward(all_or_nothing=True)(["q"], ["def square(x): return 4"], tests=[tests[0]]) == [0.0]


def test_extract_code_takes_the_last_fence():
    assert extract_code("```python\na=1\n```\ntext\n```py\nb=2\n```") == "b=2\n"
    assert extract_code("print(1)") == "print(1)"


def test_infinite_loop_is_killed_at_the_time_limit_and_does_not_stall(bwrap):
    start = time.monotonic()
    out = reward(timeout=1.0)(["q", "q"], ["while True:\n    pass", "print(1)"], tests=[[{"input": "", "output": "1"}]] * 2)
    elapsed = time.monotonic() - start
    assert out == [0.0, 1.0]
    assert elapsed < 3.0  # one 1 s timeout (tests run in parallel), not forever


def test_cpu_limit_kills_a_busy_loop_even_with_a_long_wall_clock(bwrap):
    result = run_python("while True: pass", limits=SandboxLimits(timeout=20, cpu_seconds=1))
    assert not result.timed_out and result.returncode != 0 and result.seconds < 10


def test_memory_limit(bwrap):
    result = run_python("x = bytearray(400 * 1024 * 1024)\nprint('allocated')", limits=FAST)
    assert result.returncode != 0 and "MemoryError" in result.stderr


def test_can_write_inside_its_own_directory(bwrap):
    result = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", limits=FAST)
    assert result.ok and result.stdout == "ok\n"


def test_clean_environment_and_private_working_directory(monkeypatch, bwrap):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = "import os\nprint(os.getcwd())\nprint(os.environ.get('SECRET_TOKEN'))\nprint(os.listdir('.'))"
    result = run_python(code, limits=FAST)
    assert result.stdout.split() == ["/tmp", "None", "[]"]


ESCAPES = {
    "open": "open({p!r}, 'w').write('x')",
    "os_open": "import os\nos.close(os.open({p!r}, os.O_WRONLY | os.O_CREAT))",
    "io_fileio": "import _io\n_io.FileIO({p!r}, 'w').write(b'x')",
    "pathlib": "import pathlib\npathlib.Path({p!r}).write_text('x')",
    "mkdir": "import os\nos.mkdir({p!r})",
    "rename_out": "import os\nopen('f', 'w').close()\nos.rename('f', {p!r})",
    "symlink": "import os\nos.symlink('/etc/passwd', {p!r})",
    "shell": "import os\nos.system('echo x > ' + {p!r})",
    "subprocess": "import subprocess\nsubprocess.run(['touch', {p!r}])",
    "ctypes": "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.creat({p!r}.encode(), 0o644)",
}


@pytest.mark.parametrize("isolation", ["bwrap", "unsafe_local"])
def test_cannot_write_outside_its_directory(outside: Path, isolation: str, request: pytest.FixtureRequest):
    if isolation == "bwrap":
        request.getfixturevalue("bwrap")
    for name, template in ESCAPES.items():
        target = outside / name
        result = run_python(template.format(p=str(target)), limits=FAST, isolation=isolation)
        assert not target.exists(), f"{name} ({isolation}) wrote outside the sandbox: {result}"
    assert list(outside.iterdir()) == []


def test_file_size_limit(bwrap):
    result = run_python("open('big', 'wb').write(b'x' * 10_000_000)", limits=SandboxLimits(max_output_bytes=1 << 20))
    assert result.returncode != 0


def test_cannot_signal_the_trainer(bwrap):
    result = run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nprint('sent')", limits=FAST)
    assert "sent" not in result.stdout  # the pid is not visible from inside (and we are alive)


def test_function_tests_see_plain_values_and_the_solutions_objects(bwrap):
    solution = (
        "from collections import Counter\nimport math\n"
        "class Solution:\n    def count(self, s):\n        return Counter(s)\n"
        "    def gen(self, n):\n        yield from range(n)\n"
        "def pair(a, b=2):\n    return (a, b), {a: b}, {a}, b'x', 1.5, None\n"
        "def fails():\n    raise ValueError('no')\n"
    )
    test = (
        "s = Solution()\nassert s.count('aab') == Counter('aab') == {'a': 2, 'b': 1}\n"
        "assert list(s.gen(3)) == [0, 1, 2]\nassert pair(1, b=3) == ((1, 3), {1: 3}, {1}, b'x', 1.5, None)\n"
        "assert math.isclose(math.sqrt(2), 1.41421356, rel_tol=1e-6)\n"
        "try:\n    fails()\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError\n"
        "def check(candidate):\n    assert candidate(5)[0] == (5, 2)\ncheck(pair)\n"
    )
    assert run_function_test(solution, test, FAST)


def test_without_bubblewrap_the_reward_refuses_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*sandbox: unsafe_local"):
        CodeExecution()
    weak = reward(sandbox="unsafe_local")
    program = "def double(x):\n    return 2 * x\nif __name__ == '__main__':\n    print(double(int(input())))"
    assert weak(["q"], [program], tests=[[{"input": "4", "output": "8"}, "assert double(5) == 10"]]) == [1.0]


def test_bubblewrap_is_detected_once(monkeypatch):
    sandbox.bwrap_problem.cache_clear()
    calls = []
    real = sandbox._Sandboxed
    monkeypatch.setattr(sandbox, "_Sandboxed", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = sandbox.bwrap_problem()
    probes = len(calls)  # as root: first as the unprivileged sandbox uid, then as root if that fails
    assert first == sandbox.bwrap_problem() and len(calls) == probes
    assert probes == 0 if sandbox._bwrap_path() is None else 1 <= probes <= (2 if os.geteuid() == 0 else 1)


def test_threads_work_but_processes_cannot_be_started(bwrap):
    code = (
        "import os, threading\nout = []\nt = threading.Thread(target=out.append, args=('thread',))\nt.start()\nt.join()\n"
        "try:\n    os.fork()\nexcept OSError as exc:\n    out.append(type(exc).__name__)\nprint(*out)"
    )
    assert run_python(code, limits=FAST).stdout == "thread PermissionError\n"


def test_cgroup_v2_runs_are_made_beside_the_trainers_cgroup(tmp_path: Path, monkeypatch):
    # A stand-in cgroup v2 tree (plain files): the trainer is in /svc/trainer, whose parent /svc
    # delegates pids and memory; runs go in a sibling, with pids.max and memory.max written.
    (tmp_path / "svc" / "trainer").mkdir(parents=True)
    (tmp_path / "svc" / "cgroup.subtree_control").write_text("cpu pids memory\n")
    monkeypatch.setattr(sandbox, "_cgroup_mounts", lambda: (("/", str(tmp_path)), {}))
    monkeypatch.setattr(sandbox, "_own_cgroups", lambda: {"unified": "/svc/trainer"})
    found = sandbox._find_cgroups()
    atexit.unregister(found._remove_all)  # its trial run's files are plain files here: never removable
    parent = tmp_path / "svc" / f"grpo-sandbox-{os.getpid()}"
    assert found.version == 2 and found.parents == {"pids": str(parent), "memory": str(parent)}
    assert (parent / "cgroup.subtree_control").read_text() == "+pids +memory"
    limits = SandboxLimits(memory_mb=100, disk_mb=10, max_tasks=30)
    run = found.make(limits)
    assert [(Path(d) / "pids.max").read_text() for d in run.dirs] == ["32"]
    assert [(Path(d) / "memory.max").read_text() for d in run.dirs] == [str((100 + 10 + 64) << 20)]
    dirs = list(run.dirs)
    for d in dirs:  # a real cgroup directory holds only kernel files, which rmdir ignores
        for f in Path(d).iterdir():
            f.unlink()
    found.release(run)
    assert dirs and not any(os.path.exists(d) for d in dirs)
    (tmp_path / "svc" / "cgroup.subtree_control").write_text("cpu\n")  # not delegated: no cgroups
    with pytest.raises(OSError, match="does not delegate"):
        sandbox._find_cgroups()


def test_tests_still_run_when_no_worker_thread_can_start(monkeypatch, bwrap):
    import concurrent.futures as cf

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(cf.ThreadPoolExecutor, "submit", no_thread)
    tests = [[{"input": "2 3", "output": "5"}, "assert add(2, 3) == 5"]] * 2
    right = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    completions = [right, "def add(a, b):\n    return 0"]
    assert reward()(["q", "q"], completions, tests=tests) == [1.0, 0.0]


def test_the_reward_says_which_bound_applies(monkeypatch, bwrap):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox, "_RUN_AS", [None])
    monkeypatch.setattr(sandbox, "_CGROUPS", [None])
    text, bounded = sandbox.host_bounds()
    assert not bounded and "bounded only by its address space" in text
    monkeypatch.setattr(sandbox, "_RUN_AS", [65534])
    text, bounded = sandbox.host_bounds()
    assert not bounded and text.startswith("no per-run cgroup: tasks bounded by RLIMIT_NPROC") and "uid 65534" in text
    monkeypatch.setattr(sandbox, "_CGROUPS", [sandbox._Cgroups.__new__(sandbox._Cgroups)])
    sandbox._CGROUPS[0].version = 2
    assert sandbox.host_bounds() == ("a pids and memory cgroup (v2) per run; bwrap runs as host uid 65534", True)
