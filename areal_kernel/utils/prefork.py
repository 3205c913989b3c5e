"""Pre-imported process starts: fork ``python -m <module>`` programs from a
server that has already imported torch and transformers.

Every server, train rank and ``areal train`` the kernel (or a test suite)
starts is a fresh interpreter that spends seconds importing the same heavy
packages (torch ~2 s, transformers ~3 s on a 2-core machine) before it does
anything. A prefork server imports them once; a start through it forks a
copy that has them already and runs the program in it.

How a start goes (all on one machine, one user):

1. ``start_server(dir)`` runs ``python -m areal_kernel.utils.prefork`` once:
   it imports ``PRELOAD``, listens on a Unix socket in a private directory and
   exits when the process that started it is gone.
2. With ``PREFORK_ENV`` (the socket's path) set, ``popen(argv, ...)`` (the
   ``subprocess.Popen`` signature, a ``subprocess.Popen`` subclass) sends the
   request (argv, env, cwd, session flags) and the child's stdin/stdout/stderr
   over the socket. The server forks a *keeper*, which forks the program's
   process and answers with its pid; the keeper waits for it and sends its
   wait status back, so ``wait``/``poll``/``returncode``/``communicate``
   behave as for a child of the caller (pipes included).
3. The program's process takes the request's stdio, session or process
   group, command line (``/proc/<pid>/cmdline``, what ``ps`` shows), working
   directory, environment, ``sys.argv`` and ``sys.path`` (as ``python -m``
   would set them), runs the module as ``__main__`` and ends
   through the normal interpreter exit (exit code, uncaught exception,
   ``KeyboardInterrupt`` as death by SIGINT, non-daemon threads joined,
   ``atexit``, buffered files flushed).

A start that the server cannot serve *exactly* as a fresh interpreter would
falls back to a plain fork-exec, with the reason in the server's log:
- not ``[<the server's interpreter>, "-m", <module>, ...]`` (another program,
  interpreter flags, a shell, ``preexec_fn``, ``pass_fds``, user/group/umask
  changes);
- an environment that differs from the server's in a variable the preloaded
  packages may have read when they were imported (everything but
  ``RUNTIME_ENV``/``RUNTIME_ENV_PREFIXES``: the launchers' own per-process
  variables); ``PYTHONPATH`` may add directories in front, unless one of them
  holds a package the server already imported from elsewhere;
- a working directory that does not exist (the plain start then raises the
  usual error).

Only the program's process runs user code; the keeper runs none. Signals
reach the program's process directly (its pid is real); a program started
with ``start_new_session=True`` leads its own session, so ``os.killpg`` works
as usual. The server's processes never outlive the program they keep.

This module imports only the standard library.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import Any

__all__ = [
    "PREFORK_ENV",
    "PRELOAD",
    "PreforkServer",
    "popen",
    "env_refusal",
    "refusal",
    "run",
    "set_cmdline",
    "start_server",
]

# The socket of the prefork server a process (and the processes it starts) may use.
PREFORK_ENV = "AREAL_PREFORK_SOCKET"
MODULE = "areal_kernel.utils.prefork"

# What the server imports before it serves: what nearly every kernel
# process (servers, ranks, ``areal train``) imports first. Model-family
# modules that only some load stay out: they import in the child.
PRELOAD: tuple[str, ...] = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "pydantic",
    "yaml",
    "aiohttp",
)

# Variables a launcher sets per process and that nothing preloaded reads at
# import: a request may differ from the server's environment in these.
RUNTIME_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PWD", "OLDPWD", "_",
    "PYTHONBREAKPOINT",  # read by breakpoint() when called (Ray's driver sets it in its own environment)
})  # fmt: skip
RUNTIME_ENV_PREFIXES: tuple[str, ...] = ("AREAL_",)

_HEADER = struct.Struct("!I")
# Beside the socket: what preloading changed in the server's environment.
IMPORT_ENV_SUFFIX = ".import-env.json"
_READY = "prefork-ready"


# -- the server -------------------------------------------------------------------


class _BecomeProgram(Exception):
    """Raised in a freshly forked program process to leave the server's stack
    before the program runs (so no server frame stays below it)."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__("become the program")
        self.request = request


def _say(msg: str) -> None:
    print(f"areal prefork [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("the peer closed the connection")
        buf += part
    return buf


def _send_json(conn: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(_HEADER.pack(len(data)) + data)


def _recv_json(conn: socket.socket) -> dict[str, Any]:
    (n,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    return json.loads(_recv_exact(conn, n))


def _split_path(value: str) -> list[str]:
    return [p for p in value.split(os.pathsep) if p]


def env_refusal(env: dict[str, str], base_env: dict[str, str], import_changes: dict[str, str]) -> str | None:
    """The environment part of ``refusal``: the first variable (PYTHONPATH
    aside) in which ``env`` differs from what the server's preloaded packages
    saw, or ``None``."""
    for key in sorted(set(env) | set(base_env) | set(import_changes)):
        if key == "PYTHONPATH" or key in RUNTIME_ENV or key.startswith(RUNTIME_ENV_PREFIXES):
            continue
        if key in import_changes and env.get(key) in (None, import_changes[key]):
            continue  # what the import would have set (or the same value, set before)
        if env.get(key) != base_env.get(key):
            return f"environment variable {key} differs from the server's"
    return None


def refusal(
    request: dict[str, Any], base_env: dict[str, str], import_changes: dict[str, str], loaded: dict[str, str]
) -> str | None:
    """Why a server started with environment ``base_env``, whose preloading
    changed ``import_changes`` in it and imported the top-level packages
    ``loaded`` (name -> directory or file it came from), cannot run
    ``request`` as a fresh interpreter would; ``None`` when it can."""
    env: dict[str, str] = request["env"]
    reason = env_refusal(env, base_env, import_changes)
    if reason is not None:
        return reason
    ours = _split_path(base_env.get("PYTHONPATH", ""))
    theirs = _split_path(env.get("PYTHONPATH", ""))
    if theirs[len(theirs) - len(ours) :] != ours or len(theirs) < len(ours):
        return "PYTHONPATH does not end with the server's"
    for directory in theirs[: len(theirs) - len(ours)]:
        for name, origin in loaded.items():
            for candidate in (os.path.join(directory, name), os.path.join(directory, name + ".py")):
                if os.path.exists(candidate) and os.path.realpath(candidate) != origin:
                    return f"PYTHONPATH entry {directory} holds {name}, which the server imported from {origin}"
    if not request["start_new_session"] and request["sid"] != os.getsid(0):
        return "the caller is in another session (only a new session or the caller's group would be right)"
    if not os.path.isdir(request["cwd"]):
        return f"working directory {request['cwd']} does not exist"
    return None


def _loaded_top_level() -> dict[str, str]:
    """Top-level packages/modules imported now, with where they came from."""
    out: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        if "." in name or mod is None:
            continue
        path = getattr(mod, "__file__", None)
        if not path:
            continue
        if os.path.basename(path) == "__init__.py":
            path = os.path.dirname(path)
        out[name] = os.path.realpath(path)
    return out


# The program's command line buffer: /proc/<pid>/cmdline points into it for
# the rest of the process's life.
_CMDLINE: Any = None


def set_cmdline(argv: list[str]) -> str | None:
    """Make ``/proc/self/cmdline`` (what ``ps`` and process finders read) say
    ``argv``, NUL-separated as an exec would leave it; ``None`` on success,
    else why not. A forked process keeps its parent's command line, and every
    tool that finds a server or rank by its command line would miss it.
    Uses ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` (Linux 3.18+, no privilege
    needed), moving only the argument area."""
    global _CMDLINE
    import ctypes

    class _MMMap(ctypes.Structure):
        _fields_ = [
            *((name, ctypes.c_uint64) for name in (
                "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
                "arg_start", "arg_end", "env_start", "env_end",
            )),
            ("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32),
        ]  # fmt: skip

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError as e:
        return f"no /proc or libc here ({e})"
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 49:
        return "/proc/self/stat lacks the memory-map fields (Linux before 3.5)"

    def field(n: int) -> int:  # proc(5) numbers fields from 1; ``fields`` starts at field 3
        return int(fields[n - 3])

    data = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    buf = ctypes.create_string_buffer(data, len(data))
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_long]
    mm = _MMMap(
        field(26), field(27), field(45), field(46), field(47), libc.sbrk(0), field(28),
        ctypes.addressof(buf), ctypes.addressof(buf) + len(data), field(50), field(51),
        None, 0, 0xFFFFFFFF,
    )  # fmt: skip
    pr_set_mm, pr_set_mm_map = 35, 14
    if libc.prctl(pr_set_mm, pr_set_mm_map, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        err = ctypes.get_errno()
        return f"prctl(PR_SET_MM_MAP) failed: {os.strerror(err)}"
    _CMDLINE = buf
    return None


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _keep(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the keeper: fork the program's process, report its pid, wait for
    it and report its wait status. Never returns in the keeper; raises
    ``_BecomeProgram`` in the program's process."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        # The keeper is in neither the program's session nor its group, but
        # a signal for the server's group must not end it before it reported.
        signal.signal(sig, signal.SIG_IGN)
    placed_r, placed_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        _send_json(conn, {"error": f"fork failed: {e}"})
        os._exit(1)
    if pid == 0:
        os.close(placed_r)
        _take_place(request, fds, conn)
        os.close(placed_w)  # placed: its session, group and stdio are set
        raise _BecomeProgram(request)
    os.close(placed_w)
    for fd in fds:
        os.close(fd)
    fds.clear()
    # As a plain start returns only after the exec, the pid is reported once
    # the program's process is in its session or group (EOF either way).
    while os.read(placed_r, 1):
        pass
    os.close(placed_r)
    try:
        _send_json(conn, {"pid": pid})
    except OSError:
        pass
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    try:
        _send_json(conn, {"status": status})
    except OSError:
        pass
    os._exit(0)


def _take_place(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the program's process, still inside the server's frames: the
    process-level state of a fresh start (session or group, signal
    dispositions, stdio), and nothing of the server's open."""
    if request["start_new_session"]:
        os.setsid()
    elif request["process_group"] is not None and request["process_group"] >= 0:
        os.setpgid(0, request["process_group"])
    else:  # the caller's group (``refusal`` checked that it is in our session)
        os.setpgid(0, request["pgid"])
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    set_cmdline(request["argv"])  # the server checked at its start that this works here
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    fds.clear()  # the server's clean-up must not close these numbers again
    conn.close()


def serve(sock_path: str, parent_pid: int, preload: list[str]) -> None:
    """The server's loop: serve requests until the parent is gone."""
    import importlib

    # The environment the preloaded packages saw, and what importing them
    # changed in it (torch sets TORCHINDUCTOR_CACHE_DIR): a fresh start with
    # the same environment would make the same changes.
    base_env = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a machine without one of them: serve without it
            _say(f"not preloading {name}: {e}")
    # What preloading created lives as long as the server: out of the
    # collector's sight, the programs' collections neither walk it nor
    # touch (and so copy) its pages.
    import gc

    gc.collect()
    gc.freeze()
    # A Ctrl-C for the starter's group is not for the server: it ends with its parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import_changes = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    loaded = _loaded_top_level()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        # Forking a process with other threads copies only the forking one;
        # a lock another thread held stays held forever in the copy.
        _say(f"refusing to serve: {threads} threads after preloading (forks would be unsafe)")
        return
    with open(sock_path + IMPORT_ENV_SUFFIX, "w") as f:
        json.dump(import_changes, f)
    # A program must show its own command line, not the server's: a server
    # that cannot set one serves nothing (every start is then a plain one).
    why = set_cmdline(sys.orig_argv)
    if why is not None:
        _say(f"refusing to serve: cannot set a program's command line here: {why}")
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    try:
        print(_READY, flush=True)
    except OSError:  # a starter that does not wait closed the pipe
        pass
    while True:
        _reap()
        if os.getppid() != parent_pid:
            _say(f"parent process {parent_pid} is gone; stopping")
            listener.close()
            return
        readable, _, _ = select.select([listener], [], [], 1.0)
        if not readable:
            continue
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(10)
            msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            if len(msg) < _HEADER.size:
                msg += _recv_exact(conn, _HEADER.size - len(msg))
            (n,) = _HEADER.unpack(msg)
            request = json.loads(_recv_exact(conn, n))
            conn.settimeout(None)
            reason = (
                refusal(request, base_env, import_changes, loaded) if len(fds) == 3 else "expected 3 file descriptors"
            )
            if reason is not None:
                _say(f"plain start for {request.get('argv', ['?'])[:3]}: {reason}")
                _send_json(conn, {"refused": reason})
                continue
            request["env"] = {**request["env"], **import_changes}
            sys.stdout.flush()
            sys.stderr.flush()
            keeper = os.fork()
            if keeper == 0:
                listener.close()
                _keep(conn, request, fds)
        except (OSError, ValueError, ConnectionError) as e:
            _say(f"bad request: {e}")
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            conn.close()


def _become(request: dict[str, Any]) -> None:
    """In the program's process, out of the server's frames: the
    interpreter-level state ``python -m`` would give it."""
    # Fresh stdio objects: the server's wrapped its own starter's pipe and log.
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.open(fd, "rb" if fd == 0 else "wb", closefd=False)  # noqa: SIM115 - lives as long as the process
        stream = io.TextIOWrapper(
            raw,
            encoding=old.encoding,
            errors="backslashreplace" if fd == 2 else old.errors,
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=fd == 2,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    theirs = _split_path(request["env"].get("PYTHONPATH", ""))
    added = theirs[: len(theirs) - len(_split_path(request["server_pythonpath"]))]
    sys.path[:] = [os.getcwd(), *added, *sys.path[1:]]
    sys.orig_argv = list(request["argv"])
    sys.argv = list(request["argv"][2:])  # [module, args...]; runpy puts the file's path first


def _run_program(request: dict[str, Any]) -> None:
    import runpy

    _become(request)
    module = sys.argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--socket", required=True, help="path of the Unix socket to listen on")
    p.add_argument("--parent-pid", type=int, required=True, help="stop once this process is gone")
    p.add_argument("--preload", default=",".join(PRELOAD), help="comma-separated modules to import first")
    ns = p.parse_args(args)
    try:
        serve(ns.socket, ns.parent_pid, [m for m in ns.preload.split(",") if m])
    except _BecomeProgram as b:
        request = b.request
    else:
        try:
            os.unlink(ns.socket)
        except OSError:
            pass
        return
    # Out of every server frame: the program runs here, and ends through the
    # interpreter's own exit (SystemExit, an uncaught exception, atexit, flushes).
    request["server_pythonpath"] = os.environ.get("PYTHONPATH", "")
    _run_program(request)


# -- the client -------------------------------------------------------------------

_EXEC_PARAMS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]  # type: ignore[attr-defined]


def _same_interpreter(path: str) -> bool:
    try:
        return os.path.samefile(path, sys.executable)
    except OSError:
        return False


def _request(a: dict[str, Any]) -> dict[str, Any] | None:
    """The server request for these ``_execute_child`` arguments, or ``None``
    when the start is not of the kind a server runs."""
    args = a["args"]
    if a.get("shell") or a.get("preexec_fn") is not None or a.get("pass_fds") or a.get("executable") is not None:
        return None
    if any(a.get(k) not in (None, -1) for k in ("gid", "gids", "uid")) or a.get("umask", -1) != -1:
        return None
    if not a.get("close_fds", True):
        return None
    if isinstance(args, (str, bytes)) or len(args) < 3:
        return None
    args = [os.fsdecode(x) for x in args]
    if args[1] != "-m" or args[2].startswith("-") or not _same_interpreter(args[0]):
        return None
    env = a["env"]
    env = dict(os.environ) if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    cwd = os.fsdecode(a["cwd"]) if a["cwd"] is not None else os.getcwd()
    return {
        "argv": args,
        "env": env,
        "cwd": os.path.abspath(cwd),
        "start_new_session": bool(a.get("start_new_session")),
        "process_group": a.get("process_group", -1),
        "pgid": os.getpgrp(),
        "sid": os.getsid(0),
    }


class _PreforkPopen(subprocess.Popen):
    """``subprocess.Popen`` that starts eligible ``python -m`` programs
    through the prefork server named by ``PREFORK_ENV`` (``popen``'s docs)."""

    _prefork_conn: socket.socket | None = None
    preforked = False

    def _execute_child(self, *args: Any) -> None:
        a = dict(zip(_EXEC_PARAMS, args))
        sock_path = os.environ.get(PREFORK_ENV, "")
        request = _request(a) if sock_path else None
        if request is not None and self._start_preforked(sock_path, request, a):
            return
        super()._execute_child(*args)  # type: ignore[misc]

    def _start_preforked(self, sock_path: str, request: dict[str, Any], a: dict[str, Any]) -> bool:
        def child_fd(fd: int, default: int) -> int:
            return fd if fd != -1 else default

        stdio = [child_fd(a["p2cread"], 0), child_fd(a["c2pwrite"], 1), child_fd(a["errwrite"], 2)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(sock_path)
            data = json.dumps(request).encode()
            socket.send_fds(conn, [_HEADER.pack(len(data))], stdio)
            conn.sendall(data)
            answer = _recv_json(conn)
        except (OSError, ConnectionError, ValueError):
            conn.close()
            return False  # no server (any more): a plain start
        if "pid" not in answer:
            conn.close()
            return False
        conn.settimeout(None)
        self.pid = answer["pid"]
        self._prefork_conn = conn
        self.preforked = True
        self._child_created = True
        # What a plain start does once the child has its copies of the pipes.
        self._close_pipe_fds(  # type: ignore[attr-defined]
            a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"], a["errread"], a["errwrite"]
        )
        return True

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        conn = self._prefork_conn
        if conn is None:
            return super()._try_wait(wait_flags)  # type: ignore[misc]
        if wait_flags & os.WNOHANG:
            readable, _, _ = select.select([conn], [], [], 0)
            if not readable:
                return 0, 0
        try:
            status = int(_recv_json(conn)["status"])
        except (OSError, ConnectionError, ValueError, KeyError):
            # The keeper is gone without a word (killed): the status is lost.
            status = 255 << 8
        conn.close()
        self._prefork_conn = None
        self._prefork_done = True
        return self.pid, status

    def _internal_poll(self, _deadstate: Any = None, *args: Any, **kwargs: Any) -> int | None:
        if not self.preforked:
            return super()._internal_poll(_deadstate, *args, **kwargs)  # type: ignore[misc]
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
                return None
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode


def popen(args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, through the prefork server named
    by ``PREFORK_ENV`` when one is set and the start is one it can run exactly
    (see the module docstring); a plain start otherwise. ``.preforked`` says
    which happened."""
    return _PreforkPopen(args, **kwargs)


def run(
    args: Any,
    *,
    input: Any = None,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:  # noqa: A002, E501
    """``subprocess.run`` over ``popen``."""
    if capture_output:
        kwargs["stdout"] = subprocess.PIPE
        kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        except BaseException:
            proc.kill()
            raise
        rc = proc.poll()
        assert rc is not None
    if check and rc:
        raise subprocess.CalledProcessError(rc, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, rc, out, err)


class PreforkServer:
    """A running prefork server (``start_server``); ``env`` is what a process
    that should use it needs (``PREFORK_ENV``)."""

    def __init__(
        self, proc: subprocess.Popen, socket_path: str, log_path: str, directory: str, base_env: dict[str, str]
    ) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self.log_path = log_path
        self.directory = directory
        self.base_env = base_env

    def drifted(self, env: Any = None) -> str | None:
        """Why the server could no longer start a program with environment
        ``env`` (default: this process's), or ``None``: a long-lived starter
        whose own environment changed (a library it imported set a
        variable) restarts its server rather than falling back to plain
        starts for good. ``None`` too while the server is still preloading."""
        try:
            with open(self.socket_path + IMPORT_ENV_SUFFIX) as f:
                import_changes = json.load(f)
        except (OSError, ValueError):
            return None
        return env_refusal(dict(os.environ if env is None else env), self.base_env, import_changes)

    @property
    def env(self) -> dict[str, str]:
        return {PREFORK_ENV: self.socket_path}

    def stop(self) -> None:
        """End the server (the programs it started keep running)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.socket_path, self.socket_path + IMPORT_ENV_SUFFIX):
            try:
                os.unlink(path)
            except OSError:
                pass


def start_server(
    directory: str | None = None, *, preload: tuple[str, ...] = PRELOAD, wait: bool = True, timeout: float = 120
) -> PreforkServer:
    """Start a prefork server with this process's environment. Its socket
    lives in a new private directory (under ``directory``); its log
    (preloading, plain-start reasons) beside it. With ``wait``, return once
    it serves (``RuntimeError`` with the log when it does not come up);
    without, return at once: starts fall back to plain ones until the socket
    accepts."""
    d = tempfile.mkdtemp(prefix="areal-prefork-", dir=directory)
    os.chmod(d, 0o700)
    sock_path = os.path.join(d, "socket")
    log_path = os.path.join(d, "server.log")
    env = {k: v for k, v in os.environ.items() if k != PREFORK_ENV}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--socket", sock_path, "--parent-pid", str(os.getpid()),
             "--preload", ",".join(preload)],
            stdout=subprocess.PIPE if wait else subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    server = PreforkServer(proc, sock_path, log_path, d, env)
    if not wait:
        return server
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if readable else b""
    proc.stdout.close()
    if line.decode().strip() != _READY:
        server.stop()
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"the prefork server did not start (log {log_path}):\n{f.read()[-2000:]}")
    return server


if __name__ == "__main__":
    main()
