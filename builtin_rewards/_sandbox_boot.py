"""Boot script of the code sandbox, run as ``python -I -S _sandbox_boot.py CONFIG_JSON``.

It locks the process down before the untrusted program runs, in this order:

1. resource limits (CPU seconds, address space, file size, open files, no core dumps), soft =
   hard, so the program cannot raise them;
2. Landlock (Linux >= 5.13, unprivileged, enforced by the kernel and inherited by children):
   every kind of filesystem write is refused outside the sandbox directory (``/dev/null``
   excepted), TCP bind/connect are refused (ABI >= 4), and signals to processes outside the
   sandbox are refused (ABI >= 6);
3. an audit hook (cannot be removed from Python) that refuses writes outside the sandbox
   directory, starting processes, ctypes, signals, sockets and changing resource limits -- the
   whole protection where Landlock is unavailable, a second layer where it is.

Then it runs ``solution.py`` from the sandbox directory as ``__main__``.
"""

import json
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
    """Apply Landlock; returns the ABI version used (0: not available)."""
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
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
        os.close(pfd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
    if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(fd)
    return abi


def _audit_hook(sandbox: str):  # type: ignore[no-untyped-def]
    real = os.path.realpath
    root = real(sandbox)
    allowed_files = {"/dev/null"}
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

    def inside(path) -> bool:  # type: ignore[no-untyped-def]
        if isinstance(path, int):
            return True  # an already open descriptor
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            path = os.fspath(path)
        p = real(path)
        return p == root or p.startswith(root + os.sep) or p in allowed_files

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event, args):  # type: ignore[no-untyped-def]
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} is not allowed")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")
        elif event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")

    return hook


def main() -> None:
    config = json.loads(sys.argv[1])
    sandbox = config["dir"]
    for limit, value in (
        (resource.RLIMIT_CPU, config["cpu_seconds"]),
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"]),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    os.chdir(sandbox)
    if config.get("landlock", True):
        _landlock(sandbox)
    with open(os.path.join(sandbox, "solution.py"), encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "solution.py", "exec")
    del sys.argv[1:]
    if config.get("audit_hook", True):
        sys.addaudithook(_audit_hook(sandbox))
    exec(code, {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
