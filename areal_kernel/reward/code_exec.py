"""``code_exec`` reward: run a model's Python against the task's tests, in a
sandboxed subprocess.

The completion is untrusted code. It runs in a fresh interpreter (``python
-I``, program on stdin) in its own session and an empty scratch directory,
with:

- wall time: the whole process group is SIGKILLed after ``timeout_s``;
- memory: ``RLIMIT_AS`` of ``memory_mb`` per process;
- processes: ``RLIMIT_NPROC`` (a fork bomb gets EAGAIN). Linux does not apply
  that limit to root, so when the parent is root the child runs as
  ``nobody`` (which also keeps it away from root's files);
- environment: only a minimal ``PATH``/``LANG``/``HOME`` — nothing of the
  parent's (API keys, tokens, cloud credentials), and ``-I`` ignores
  ``PYTHON*`` variables and the user site.

Score: 1.0 if the program (completion code, then the ``answer`` tests)
exits 0 within the limits, else 0.0.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
NOBODY = 65534
# The child's whole environment: enough to run Python, nothing inherited.
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


@dataclass
class ExecResult:
    returncode: int | None  # None: killed for running out of time
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float


def extract_code(completion: str) -> str:
    """The last fenced code block of a chat answer, else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _interpreter(drop_to_nobody: bool) -> str:
    # A dropped-privilege child must be able to read the interpreter; a venv
    # under /root (mode 0700) is not readable by nobody, the system one is.
    if drop_to_nobody:
        for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
            if os.path.exists(cand):
                return cand
    return sys.executable


def _count_user_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _wait_group_gone(pgid: int, limit_s: float) -> None:
    # Killed descendants linger until their new parent reaps them; wait a
    # little so callers (and the next sample) see the slots free again.
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)


def run_untrusted(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 8,
    python: str | None = None,
    output_limit: int = 64 << 10,
) -> ExecResult:
    """Run ``code`` under the limits above and return what happened."""
    drop = os.geteuid() == 0
    uid = NOBODY if drop else os.getuid()
    # NPROC counts every process of the user; as a normal user the child
    # shares the count with the parent's other processes, so add those.
    nproc = max_processes if drop else _count_user_processes(uid) + max_processes
    mem = memory_mb << 20

    def limit() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))

    workdir = tempfile.mkdtemp(prefix="areal-code-")
    try:
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
        popen_kw: dict = {}
        if drop:
            popen_kw.update(user=NOBODY, group=NOBODY, extra_groups=[])
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [python or _interpreter(drop), "-I", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=dict(SAFE_ENV),
            start_new_session=True,  # its own process group: one killpg reaches every fork
            preexec_fn=limit,
            **popen_kw,
        )
        timed_out = False
        try:
            out, err = proc.communicate(code.encode("utf-8", "replace"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            out, err = b"", b""
        finally:
            # Whatever it forked dies with it (also on success: no daemons left).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if timed_out:
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                # A descendant escaped the group (setsid) and holds the pipes:
                # stop reading; NPROC and the memory limit still bound it.
                proc.kill()
                for f in (proc.stdout, proc.stderr, proc.stdin):
                    if f is not None:
                        f.close()
                proc.wait()
        _wait_group_gone(proc.pid, 5.0)
        seconds = time.monotonic() - t0
        return ExecResult(
            None if timed_out else proc.returncode,
            timed_out,
            out[:output_limit].decode("utf-8", "replace"),
            err[:output_limit].decode("utf-8", "replace"),
            seconds,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def code_exec_reward(
    completion: str,
    answer: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 8,
) -> float:
    """1.0 if the completion's code passes ``answer`` (Python test code, e.g.
    ``assert add(2, 3) == 5``) within the limits, else 0.0."""
    code = extract_code(completion)
    if not code.strip():
        return 0.0
    program = code.rstrip() + "\n\n" + answer.strip() + "\n"
    res = run_untrusted(program, timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes)
    return 1.0 if res.returncode == 0 and not res.timed_out else 0.0
