"""Worker processes for ``executor: process`` rewards (CPU-heavy or untrusted code).

Each such reward gets one long-lived worker process (spawned, so no fork of a threaded torch
parent), which is killed on a timeout and restarted on the next call.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import threading
import traceback
from typing import Any


def worker_main(conn: Any, fn: Any) -> None:
    """Loop of a reward worker process: receive kwargs, send back the result or the error."""
    conn.send(("ready",))  # ``fn`` (and its module) is loaded: calls are timed from here on
    while True:
        try:
            kwargs = conn.recv()
        except EOFError:
            return
        if kwargs is None:
            return
        try:
            result = fn(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(await_result(result))
            conn.send(("ok", result if isinstance(result, list) else list(result)))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


async def await_result(awaitable: Any) -> Any:
    """Await ``awaitable`` (for ``asyncio.run`` and ``run_coroutine_threadsafe``)."""
    return await awaitable


class CallFailed(Exception):
    """Internal: one reward call failed as a whole (raised, crashed, timed out)."""

    def __init__(self, what: str, *, timed_out: bool = False) -> None:
        super().__init__(what)
        self.what = what
        self.timed_out = timed_out


class ProcessWorker:
    """One long-lived worker process for an ``executor: process`` reward (killed on timeout).

    The reward is sent once, when the worker starts; its start-up (importing the reward's
    module) does not count against the reward's timeout, but must finish within
    ``STARTUP_TIMEOUT`` seconds.
    """

    STARTUP_TIMEOUT = 300.0

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded (torch) parent
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(child, self.fn), daemon=True)
        try:
            proc.start()
        except Exception as exc:  # e.g. a lambda or a local function cannot be pickled
            raise CallFailed(
                f"cannot be sent to a worker process ({type(exc).__name__}: {exc}); "
                "use a module-level function or executor: thread"
            ) from None
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(self.STARTUP_TIMEOUT):
            self.kill()
            raise CallFailed(f"worker process did not start within {self.STARTUP_TIMEOUT:g} s")
        try:
            parent.recv()
        except EOFError:
            code = proc.exitcode if proc.join(5) is None else None
            self.kill()
            raise CallFailed(f"worker process failed to start (exit code {code}); is the reward importable?") from None

    def call(self, kwargs: dict[str, Any], timeout: float | None) -> Any:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send(kwargs)
            if not self._conn.poll(timeout):
                self.kill()
                raise CallFailed(f"timed out after {timeout:g} s", timed_out=True)
            try:
                reply = self._conn.recv()
            except EOFError:
                code = self._proc.exitcode
                self.kill()
                raise CallFailed(f"worker process died (exit code {code})") from None
            if reply[0] == "err":
                raise CallFailed(reply[1])
            return reply[1]

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(None)
                    self._proc.join(2)
                except (OSError, BrokenPipeError):
                    pass
            self.kill()
