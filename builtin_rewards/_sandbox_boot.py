"""Trusted start-up code inside the code sandbox, run as ``python -I -S -B -c SOURCE CONFIG [DIR]``.

:mod:`builtin_rewards.sandbox` passes this file's text with ``-c`` (nothing of the project is
visible inside the sandbox). Standard library only; it runs in the sandboxed interpreter.

1. Resource limits, soft = hard so the program cannot raise them: CPU seconds, address space,
   file size (also caps its output), open files, tasks, queued signals, no core dumps.
2. With ``weak`` (the ``unsafe_local`` fallback, no bubblewrap): Landlock and an audit hook, the
   older home-made write protection (see docs/rewards.md for what it does not contain).
3. The mode:

   * ``main`` -- run the program (the first ``source`` bytes of stdin) as ``__main__``; the rest
     of stdin is its input.
   * ``serve`` -- untrusted side of a function-call test: load the program as module
     ``solution``, then answer call requests over the channel fds with plain data (JSON). The
     solution shares this process, so everything it sends is the solution's to forge.
   * ``test`` -- trusted side, in a separate sandbox: run the test code (stdin) with the
     solution's names bound to proxies that call into the ``serve`` sandbox; only plain data
     comes back, decoded by value, so every comparison is made here, never by the solution's
     code, and nothing the solution names is imported here. Each reply must echo the random id
     of its request. Writes ``PASS <nonce>`` to the verdict file when the test code ran to its
     end (only this process holds that file and knows the nonce).
"""

from __future__ import annotations  # annotations use only builtins: no typing import at start-up

import builtins
import os
import resource
import sys

# Landlock ABI constants (linux/landlock.h); syscall numbers are the same on x86_64 and arm64.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_PR_SET_NO_NEW_PRIVS = 38


def _landlock(sandbox: str) -> int:
    """Apply Landlock (weak mode only); returns the ABI version used (0: not available)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    writes = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        writes |= _REFER
    if abi >= 3:
        writes |= _TRUNCATE

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = RulesetAttr(writes, 0, 0)
    size = 8
    if abi >= 4:
        attr.net, size = _NET_BIND_TCP | _NET_CONNECT_TCP, 16
    if abi >= 6:
        attr.scoped, size = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL, 24
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path, allowed in ((sandbox, writes), ("/dev/null", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))):
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, pfd)
        if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_add_rule(%s) failed" % path)
        os.close(pfd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
    if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(fd)
    return abi


def _audit_hook(sandbox: str) -> object:
    """Refuse writes outside ``sandbox``, processes, ctypes, signals, sockets (weak mode only)."""
    real = os.path.realpath
    root = real(sandbox)
    blocked = (
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "pty.spawn", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill",
        "resource.setrlimit", "resource.prlimit", "socket.connect", "socket.bind",
        "socket.sendto", "os.putenv", "os.unsetenv",
    )
    path_events = {
        "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
        "os.truncate": 1, "os.utime": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
        "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.copytree": 2, "shutil.move": 2,
        "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1, "os.mkfifo": 1,
        "os.mknod": 1,
    }

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True
        p = real(os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path))
        return p == root or p.startswith(root + os.sep) or p == "/dev/null"

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and path is not None and not inside(path):
                raise PermissionError("sandbox: writing %r is not allowed" % (path,))
        elif event in path_events:
            for path in args[: path_events[event]]:
                if path is not None and not inside(path):
                    raise PermissionError("sandbox: %s on %r is not allowed" % (event, path))
        elif event.startswith(blocked):
            raise PermissionError("sandbox: %s is not allowed" % event)

    return hook


# -- plain data over the channel -------------------------------------------------------------
# JSON; everything that is not None/bool/int/float/str/list is a tagged object {"$": tag, "v": ...}.
# An object that is not plain data stays in the serve process and travels as a reference.

_CONTAINERS = ("tuple", "set", "frozenset", "deque")


def _encode(x: object, refs: list[object]) -> object:
    """``x`` as JSON-able plain data; other objects are appended to ``refs`` and sent by index."""
    if x is None or type(x) is bool:
        return x
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, int):
        return int.__index__(x)
    if isinstance(x, float):
        return float.__float__(x)
    if isinstance(x, complex):
        return {"$": "complex", "v": [x.real, x.imag]}
    if isinstance(x, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes(x).hex()}
    if isinstance(x, list):
        return [_encode(i, refs) for i in x]
    if isinstance(x, tuple):
        return {"$": "tuple", "v": [_encode(i, refs) for i in x]}
    if isinstance(x, (set, frozenset)):
        tag = "frozenset" if isinstance(x, frozenset) else "set"
        return {"$": tag, "v": [_encode(i, refs) for i in x]}
    if isinstance(x, dict):
        tag = type(x).__name__ if type(x).__name__ in ("Counter", "OrderedDict") else "dict"
        return {"$": tag, "v": [[_encode(k, refs), _encode(v, refs)] for k, v in x.items()]}
    if type(x).__name__ == "deque" and type(x).__module__ == "collections":
        return {"$": "deque", "v": [_encode(i, refs) for i in x]}
    refs.append(x)
    return {"$": "ref", "v": len(refs) - 1}


def _decode(x: object, ref: object) -> object:
    """The inverse of :func:`_encode`; ``ref(index)`` makes the object for a reference."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_decode(i, ref) for i in x]
    if type(x) is not dict or set(x) != {"$", "v"}:
        raise ValueError("malformed value")
    tag, v = x["$"], x["v"]
    if tag == "ref":
        return ref(v)
    if tag == "complex":
        return complex(*v)
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag in ("dict", "Counter", "OrderedDict"):
        import collections

        items = [(_decode(k, ref), _decode(i, ref)) for k, i in v]
        return {"dict": dict, "Counter": collections.Counter, "OrderedDict": collections.OrderedDict}[tag](dict(items))
    if tag in _CONTAINERS:
        import collections

        kind = {"tuple": tuple, "set": set, "frozenset": frozenset, "deque": collections.deque}[tag]
        return kind(_decode(i, ref) for i in v)
    raise ValueError("unknown tag %r" % (tag,))


class _Channel:
    """One JSON message per line over a pair of pipe fds."""

    def __init__(self, rfd: int, wfd: int, max_line: int) -> None:
        import json  # here, not at the top: a plain run starts faster without it

        self.json = json
        self.r = os.fdopen(rfd, "rb")
        self.w = os.fdopen(wfd, "wb")
        self.max_line = max_line

    def send(self, message: object) -> None:
        self.w.write(self.json.dumps(message).encode() + b"\n")
        self.w.flush()

    def receive(self) -> dict:
        line = self.r.readline(self.max_line)
        if not line.endswith(b"\n"):
            raise EOFError("the other side ended or sent too much")
        return self.json.loads(line)


def _serve(code: object, channel: _Channel) -> None:
    """Untrusted side: load the solution, then answer requests until the channel closes.

    Everything this process sends is the solution's to forge (it shares the process), so the
    test side takes each reply as no more than plain data: what the solution answered.
    """
    import types

    refs = []
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        exec(code, module.__dict__)
        names = {}
        for name, value in list(module.__dict__.items()):
            if not name.startswith("__"):
                names[name] = "module" if isinstance(value, types.ModuleType) else "object"
        loaded = {"names": names}
    except BaseException as exc:  # the solution's own failure is reported, not fatal here
        loaded = {"raise": [type(exc).__name__, str(exc)[:500]]}

    def target(t: dict) -> object:
        return module.__dict__[t["name"]] if "name" in t else refs[t["ref"]]

    while True:
        try:
            request = channel.receive()
        except EOFError:
            return
        if request["op"] == "names":
            channel.send({**loaded, "id": request["id"]})
            continue
        try:
            op, obj = request["op"], target(request["target"])
            if op == "call":
                args = _decode(request["args"], refs.__getitem__)
                kwargs = _decode(request["kwargs"], refs.__getitem__)
                value = obj(*args, **kwargs)
            elif op == "getattr":
                value = getattr(obj, request["attr"])
            elif op == "iter":
                value = iter(obj)
            else:
                try:
                    value = next(obj)
                except StopIteration:
                    channel.send({"stop": True, "id": request["id"]})
                    continue
            reply = {"value": _encode(value, refs), "id": request["id"]}
        except BaseException as exc:
            reply = {"raise": [type(exc).__name__, str(exc)[:500]], "id": request["id"]}
        try:
            channel.send(reply)
        except (TypeError, ValueError, RecursionError, OverflowError) as exc:
            channel.send({"raise": [type(exc).__name__, "the result is not plain data"], "id": request["id"]})


class RemoteError(Exception):
    """The solution raised an exception that is not re-raised as a builtin one (a class of its
    own, or one that steers control flow, such as StopIteration), sent something that is not
    plain data, or its process ended."""


def _builtin_exception(name: object) -> type:
    """The builtin exception class a solution's exception is re-raised as in the test code.

    Only ordinary errors: StopIteration (and its async twin) would end a test's ``all(map(...))``
    or ``for`` loop early, and the BaseException-only ones (SystemExit, KeyboardInterrupt,
    GeneratorExit) would end the test; those, and every other name, become RemoteError.
    """
    kind = getattr(builtins, name, None) if type(name) is str else None
    if (
        isinstance(kind, type)
        and issubclass(kind, Exception)
        and not issubclass(kind, (StopIteration, StopAsyncIteration))
    ):
        return kind
    return RemoteError


def _test_names(code: object) -> set:
    """Every global name the (compiled) test code and its nested functions refer to."""
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if type(k) is type(c))
    return names


def _run_test(code: str, channel: _Channel, nonce: str, verdict_fd: int) -> None:
    """Trusted side: run the test code against proxies of the solution's names; write the
    verdict (``PASS <nonce>``) to ``verdict_fd``, which only this process holds."""
    import importlib

    # Each request carries a fresh id the reply must echo: frames the solution wrote ahead of
    # time (at import, before any request existed) are refused rather than taken as answers.
    ids = iter(range(int.from_bytes(os.urandom(8), "little"), 1 << 65))

    def exchange(message: dict) -> dict:
        message["id"] = next(ids)
        channel.send(message)
        reply = channel.receive()
        if type(reply) is not dict or reply.get("id") != message["id"] or type(reply["id"]) is not int:
            raise ValueError("not the reply to this request")
        return reply

    def request(message: dict) -> object:
        try:
            reply = exchange(message)
            if "stop" in reply and message["op"] == "next":
                raise StopIteration  # only Remote.__next__ ends an iteration
            if "raise" in reply:
                name, text = reply["raise"]
                error = _builtin_exception(name)
                text = str(text)[:500] if type(text) is str else ""
            else:
                return _decode(reply["value"], Remote)
        except StopIteration:
            raise
        except Exception as exc:  # a malformed reply is the solution's failure, never ours
            raise RemoteError("the solution sent something that is not plain data") from exc
        if error is RemoteError:
            raise RemoteError("%s: %s" % (str(name)[:100], text))
        raise error(text)

    class Remote:
        """An object living in the solution's process: callable, with attributes, iterable.

        Comparisons and truth are Python's defaults for a plain object here: they never run the
        solution's code, so an object claiming to equal anything cannot pass a test.
        """

        def __init__(self, ref: object = None, name: str | None = None) -> None:
            if name is None and type(ref) is not int:
                raise ValueError("malformed reference")
            object.__setattr__(self, "_target", {"ref": ref} if name is None else {"name": name})

        def __call__(self, *args: object, **kwargs: object) -> object:
            return request({"op": "call", "target": self._target, "args": _plain(list(args)), "kwargs": _plain(kwargs)})

        def __getattr__(self, attr: str) -> object:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return request({"op": "getattr", "target": self._target, "attr": attr})

        def __iter__(self) -> object:
            return request({"op": "iter", "target": self._target})

        def __next__(self) -> object:
            return request({"op": "next", "target": self._target})

        def __repr__(self) -> str:
            return "<solution object>"

    def _plain(x: object) -> object:
        refs = []
        value = _encode(x, refs)
        return _swap_refs(value, refs)

    def _swap_refs(value: object, refs: list[object]) -> object:
        # Local Remote proxies are encoded as the reference the serve side knows them by.
        if type(value) is list:
            return [_swap_refs(v, refs) for v in value]
        if type(value) is dict:
            if value["$"] == "ref":
                obj = refs[value["v"]]
                if not isinstance(obj, Remote) or "ref" not in obj._target:
                    raise TypeError("only plain data and the solution's own objects can be passed to it")
                return {"$": "ref", "v": obj._target["ref"]}
            return {"$": value["$"], "v": _swap_refs(value["v"], refs)}
        return value

    compiled = compile(code, "<test>", "exec")
    hello = exchange({"op": "names"})
    if type(hello.get("names")) is not dict:
        raise RemoteError("the solution failed to load: %s" % (str(hello.get("raise"))[:500],))
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    for name, kind in hello["names"].items():
        if isinstance(name, str) and name.isidentifier() and not name.startswith("__") and not hasattr(builtins, name):
            namespace[name] = Remote(name=name)  # a builtin (abs, sorted) is always the real one
    # A standard-library module the test refers to by its own name (``math.isclose``) is this
    # side's import of that name, decided by the test's text alone -- never an object the
    # solution points at, whatever it calls it or claims it is, and never the solution's own
    # object of that name (which could answer ``math.isclose(...)`` with True).
    for name in _test_names(compiled) & set(getattr(sys, "stdlib_module_names", ())):
        try:
            namespace[name] = importlib.import_module(name)
        except Exception:
            pass
    exec(compiled, namespace)
    os.write(verdict_fd, ("PASS %s\n" % nonce).encode())


def main() -> None:
    # CONFIG is "key=value;..." (no json: importing it costs a plain run ~20% of its start-up).
    config = dict(item.split("=", 1) for item in sys.argv[1].split(";"))
    weak_dir = sys.argv[2] if len(sys.argv) > 2 else None
    del sys.argv[1:]  # the nonce lives on in this function only
    file_bytes = int(config["file_bytes"])
    for limit, value in (
        (resource.RLIMIT_CPU, int(config["cpu_seconds"])),
        (resource.RLIMIT_AS, int(config["memory_bytes"])),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_NPROC, int(config["max_tasks"])),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_SIGPENDING, 64),  # queued signals and POSIX timers: kernel memory
    ):
        resource.setrlimit(limit, (value, value))
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    chunks, left = [], int(config["source_bytes"])
    while left > 0:
        chunk = os.read(0, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    source = b"".join(chunks).decode("utf-8", errors="replace")
    mode = config["mode"]
    channel = None
    if config["channel"]:
        rfd, wfd = map(int, config["channel"].split(","))
        channel = _Channel(rfd, wfd, file_bytes)
    if mode == "test":
        verdict_fd = int(config["verdict"])
        os.set_inheritable(verdict_fd, False)
        _run_test(source, channel, config["nonce"], verdict_fd)
        return
    code = compile(source, "solution.py", "exec")
    if weak_dir:
        _landlock(weak_dir)
    if mode == "serve":
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(2, 1)  # the solution's prints must not mix with anything the parent reads
    if weak_dir:
        sys.addaudithook(_audit_hook(weak_dir))
    if mode == "serve":
        _serve(code, channel)
        return
    exec(code, {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins})


main()
