"""Fixtures for areal-sglang: SGLang's own code as an oracle (separate process),
stand-in SGLang servers (tests/sglang_standin.py) launched by the real launcher,
and small model directories for the stand-in to "load"."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sglang_testutil import STANDIN_PREFIX, make_model_dir, post_json

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
ORACLE = HERE / "sglang_oracle.py"
# The pinned sglang wheel and the few pure-python packages its modules import,
# installed with `pip install --no-deps --target` (see the Makefile's install step).
# AREAL_SGLANG_ORACLE_SITE may list several directories (os.pathsep-separated).
ORACLE_SITE = os.environ.get("AREAL_SGLANG_ORACLE_SITE", str(REPO / ".venv" / "sglang-oracle"))
ORACLE_INSTALL_HINT = (
    f"SGLang oracle packages are missing from {ORACLE_SITE}; run `make install` (or the sglang-oracle line of "
    "the Makefile's install target), or point AREAL_SGLANG_ORACLE_SITE at such a directory"
)


class _OracleProcess:
    """The oracle subprocess, started as soon as collection shows a test needs it
    (its import of SGLang takes tens of seconds; the light tests run meanwhile)."""

    proc: subprocess.Popen | None = None
    lines: list[str] = []
    port: int | None = None

    @classmethod
    def start(cls) -> None:
        if cls.proc is not None:
            return
        if not any((Path(d) / "sglang" / "srt" / "server_args.py").exists() for d in ORACLE_SITE.split(os.pathsep)):
            return  # the fixture fails with the install hint
        pypath = os.pathsep.join([ORACLE_SITE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1", AREAL_ORACLE_PARENT_PID=str(os.getpid()))
        cls.proc = subprocess.Popen(
            [sys.executable, str(ORACLE)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

        def read() -> None:
            for line in cls.proc.stdout:  # type: ignore[union-attr]
                cls.lines.append(line)
                if line.startswith("ORACLE READY"):
                    cls.port = int(line.split()[2])

        threading.Thread(target=read, daemon=True).start()

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            os.killpg(cls.proc.pid, 9)
            cls.proc.wait()


def pytest_collection_modifyitems(session, config, items):
    # Tests that need SGLang's code run last, after the oracle had time to start.
    mine = [i for i in items if str(i.fspath).startswith(str(HERE))]
    needs = [i for i in mine if "oracle_url" in getattr(i, "fixturenames", ())]
    if needs:
        _OracleProcess.start()
        rest = [i for i in items if i not in needs]
        items[:] = rest + needs


def pytest_sessionfinish(session, exitstatus):
    _OracleProcess.stop()


@pytest.fixture(scope="session")
def oracle_url() -> Any:
    """URL of a process that answers with SGLang's own parser and request classes."""
    if not any((Path(d) / "sglang" / "srt" / "server_args.py").exists() for d in ORACLE_SITE.split(os.pathsep)):
        pytest.fail(ORACLE_INSTALL_HINT)
    _OracleProcess.start()
    proc = _OracleProcess.proc
    assert proc is not None
    deadline = time.monotonic() + 300
    while _OracleProcess.port is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            _OracleProcess.stop()
            pytest.fail("the SGLang oracle did not start:\n" + "".join(_OracleProcess.lines[-40:]))
        time.sleep(0.2)
    yield f"http://127.0.0.1:{_OracleProcess.port}"


@pytest.fixture(scope="session")
def sglang_oracle(oracle_url: str):
    class Oracle:
        url = oracle_url

        @staticmethod
        def argv(argv: list[str], fields: tuple[str, ...] = ()) -> dict:
            # ``fields``: parsed values to report beyond the oracle's usual set.
            return post_json(oracle_url + "/check_argv", {"argv": argv, "fields": list(fields)})

        @staticmethod
        def request(route: str, body: Any) -> dict:
            return post_json(oracle_url + "/check_request", {"route": route, "body": body})

    return Oracle


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model-a"), 1)


@pytest.fixture(scope="session")
def alt_model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model-b"), 2)


@pytest.fixture
def launch_standins(tmp_path, oracle_url):
    """Start stand-in servers through the real SGLangLauncher; every argv and
    request body they receive is checked by the SGLang oracle."""
    from areal_sglang.config import SGLangServerConfig
    from areal_sglang.launcher import SGLangLauncher

    launchers: list[SGLangLauncher] = []

    def start(model: str, n: int = 1, devices_per_server: int = 0, **cfg: Any):
        extra_env = {"AREAL_SGLANG_ORACLE_URL": oracle_url, **cfg.pop("extra_env", {})}
        config = SGLangServerConfig(startup_timeout_s=120, stop_grace_s=5, extra_env=extra_env, **cfg)
        lau = SGLangLauncher(config, run_dir=str(tmp_path / f"run{len(launchers)}"), launch_prefix=STANDIN_PREFIX)
        launchers.append(lau)
        return lau, lau.launch(model, n_servers=n, devices_per_server=devices_per_server)

    yield start
    for lau in launchers:
        lau.stop()


@pytest.fixture(scope="session")
def sglang_env_python(tmp_path_factory) -> str:
    """A STAND-IN for an SGLang environment (SGLang cannot run on these
    machines): a venv, without pip, holding SGLang's real installed metadata
    (the oracle's ``sglang-*.dist-info``), so that resolving
    ``rollout.sglang.python`` to it passes the probe the kernel runs. Its
    servers cannot start; tests use it for commands and environments."""
    from areal_kernel.testing.envs import metadata_venv

    dists = [str(p) for d in ORACLE_SITE.split(os.pathsep) for p in Path(d).glob("sglang-*.dist-info")]
    assert dists, ORACLE_INSTALL_HINT
    return metadata_venv(str(tmp_path_factory.mktemp("sglang-env") / "venv"), {}, copy_dist_info=(dists[0],))


@pytest.fixture(scope="session")
def sglang_standin_env_python(tmp_path_factory) -> str:
    """A STAND-IN SGLang environment whose servers start: a metadata venv as
    ``sglang_env_python``'s (SGLang's real installed metadata, so the
    kernel's probe accepts it) plus a ``sglang.launch_server`` module that
    runs ``sglang_standin.py``, and a ``.pth`` that adds this interpreter's
    site-packages (torch, transformers, aiohttp, the kernel: what the
    stand-in imports). ``rollout.sglang.python`` set to it makes the real
    launcher start stand-ins with ``python -m sglang.launch_server``."""
    import sysconfig

    from areal_kernel.testing.envs import metadata_venv

    from sglang_testutil import STANDIN

    dists = [str(p) for d in ORACLE_SITE.split(os.pathsep) for p in Path(d).glob("sglang-*.dist-info")]
    assert dists, ORACLE_INSTALL_HINT
    python = metadata_venv(str(tmp_path_factory.mktemp("sglang-standin-env") / "venv"), {}, copy_dist_info=(dists[0],))
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    pkg = Path(site) / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""STAND-IN: not SGLang (tests/sglang_standin.py behind its launch command)."""\n'
    )
    (pkg / "launch_server.py").write_text(
        f"import runpy, sys\nsys.argv[0] = {str(STANDIN)!r}\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    # addsitedir, not a bare path line: it also runs that site's own .pth files (the editable installs).
    main_site = sysconfig.get_paths()["purelib"]
    (Path(site) / "areal_standin_main_site.pth").write_text(f"import site; site.addsitedir({main_site!r})\n")
    return python
