"""The launcher for real: processes, ports, health wait, log tail on failure,
process-group stop, device placement through the platform layer."""

from __future__ import annotations

import os
import sys

import pytest

from areal_kernel.errors import ConfigError, ServerError
from areal_sglang.config import SGLangServerConfig
from areal_sglang.launcher import SGLangLauncher, build_command

from sglang_testutil import STANDIN_PREFIX, standin_state


def test_server_that_exits_at_once_fails_with_its_log_tail(tmp_path, model_dir):
    crash = [sys.executable, "-c", "import sys; print('RuntimeError: no CUDA GPUs are available'); sys.exit(3)"]
    lau = SGLangLauncher(SGLangServerConfig(startup_timeout_s=60), run_dir=str(tmp_path), launch_prefix=crash)
    with pytest.raises(ServerError) as e:
        lau.launch(model_dir, n_servers=1, devices_per_server=0)
    msg = str(e.value)
    assert "exited with code 3 before becoming healthy" in msg
    assert "RuntimeError: no CUDA GPUs are available" in msg  # the log tail
    assert "--model-path" in msg and "sglang-0.log" in msg
    assert lau.servers == []


def test_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path, model_dir):
    hang = [sys.executable, "-c", "import time, sys; print('loading...', flush=True); time.sleep(600)"]
    lau = SGLangLauncher(
        SGLangServerConfig(startup_timeout_s=1.5, stop_grace_s=1), run_dir=str(tmp_path), launch_prefix=hang
    )
    with pytest.raises(ServerError, match=r"not healthy after 1.5 s \(rollout.sglang.startup_timeout_s[\s\S]*loading"):
        lau.launch(model_dir, n_servers=1, devices_per_server=0)


def test_missing_interpreter_is_a_clear_error(tmp_path, model_dir):
    """rollout.sglang.python is resolved before anything starts: a path that
    is no interpreter, and (unset) no SGLang here nor a managed environment,
    are each one line naming the setting; no server process was started."""
    lau = SGLangLauncher(SGLangServerConfig(python="/nonexistent/python"), run_dir=str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.python: '/nonexistent/python' is not an executable"):
        lau.launch(model_dir, n_servers=1, devices_per_server=0)
    assert lau.servers == []
    lau = SGLangLauncher(SGLangServerConfig(), run_dir=str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.python: unset.*areal env create sglang"):
        lau.launch(model_dir, n_servers=1, devices_per_server=0)


@pytest.mark.slow
def test_argv_rejected_by_sglang_parser_surfaces_in_the_error(tmp_path, model_dir, oracle_url):
    """The stand-in refuses to start when SGLang's own parser rejects its argv,
    as `python -m sglang.launch_server` would; the launcher shows why."""
    cfg = SGLangServerConfig(
        startup_timeout_s=60, extra_args=["--radix-cache-off"], extra_env={"AREAL_SGLANG_ORACLE_URL": oracle_url}
    )
    lau = SGLangLauncher(cfg, run_dir=str(tmp_path), launch_prefix=STANDIN_PREFIX)
    with pytest.raises(ServerError, match=r"exited with code 2[\s\S]*unrecognized arguments: --radix-cache-off"):
        lau.launch(model_dir, n_servers=1, devices_per_server=0)


@pytest.mark.slow
def test_stop_takes_down_the_whole_process_group(tmp_path, model_dir, launch_standins):
    lau, infos = launch_standins(model_dir, n=2)
    assert len({i.address for i in infos}) == 2 and all(standin_state(i.address)["version"] == "0" for i in infos)
    lau.stop()
    for info in infos:
        with pytest.raises(ProcessLookupError):
            os.killpg(info.pid, 0)


def test_devices_go_through_the_platform_visible_devices_variable(monkeypatch, tmp_path):
    import areal_kernel.platforms as platforms
    from areal_kernel.platforms.base import CudaPlatform

    monkeypatch.setattr(platforms, "current_platform", lambda: CudaPlatform())
    lau = SGLangLauncher(SGLangServerConfig(extra_env={"X": "1"}), run_dir=str(tmp_path))
    env = lau.environment(0, 1, [2, 3])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["X"] == "1"


def test_tp_size_follows_the_allocation_and_is_checked(tmp_path, model_dir):
    cmd = build_command(SGLangServerConfig(), model_dir, 1, dtype="auto", tp_size=4, seed=0)
    assert cmd[cmd.index("--tp-size") + 1] == "4"
    lau = SGLangLauncher(SGLangServerConfig(tp_size=4), run_dir=str(tmp_path))
    with pytest.raises(ServerError, match=r"tp_size=4 needs 4 devices per server.*sglang:d1t4"):
        lau.launch(model_dir, n_servers=1, devices_per_server=2)


def test_a_server_placed_beyond_loopback_gets_an_api_key(tmp_path, model_dir):
    """The kernel's token rule on host strings (nothing binds them): SGLang's
    --api-key is generated for a placement beyond loopback and sent by the
    launcher's health probe; loopback stays without; a configured key wins."""
    from areal_kernel.api.scheduler import Placement

    local = SGLangLauncher(SGLangServerConfig(), run_dir=str(tmp_path / "a"))
    local.place(None, [Placement("rollout", 0, "n0", "127.0.0.1")])
    assert local.admin_token is None and "--api-key" not in local.command(model_dir, 1, 0, [])
    remote = SGLangLauncher(SGLangServerConfig(), run_dir=str(tmp_path / "b"))
    remote.place(None, [Placement("rollout", 0, "n1", "10.1.2.3")])
    cmd = remote.command(model_dir, 1, 0, [])
    assert remote.admin_token and cmd[cmd.index("--api-key") + 1] == remote.admin_token
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3"
    assert remote.health_headers() == {"Authorization": f"Bearer {remote.admin_token}"}
    fixed = SGLangLauncher(SGLangServerConfig(api_key="k"), run_dir=str(tmp_path / "c"))
    fixed.place(None, [Placement("rollout", 0, "n1", "10.1.2.3")])
    assert fixed.admin_token == "k" and fixed.command(model_dir, 1, 0, []).count("k") == 1


def test_servers_run_from_the_resolved_environment_without_this_sides_pythonpath(
    tmp_path, model_dir, sglang_env_python, monkeypatch
):
    """rollout.sglang.python names another environment (a stand-in: SGLang's
    metadata in a bare venv): the command runs that interpreter and the
    server's environment carries none of this process's PYTHONPATH (SGLang
    imports nothing of ours); the same interpreter keeps it (the control)."""
    monkeypatch.setenv("PYTHONPATH", "/somewhere/of/ours")
    lau = SGLangLauncher(SGLangServerConfig(python=sglang_env_python), run_dir=str(tmp_path / "a"))
    lau.check_launch(model_dir, 1, 0)
    assert lau.command(model_dir, 1, 0, [])[:3] == [sglang_env_python, "-m", "sglang.launch_server"]
    assert lau.python is not None and lau.python.foreign and lau.python.source == "path"
    assert "PYTHONPATH" not in lau.environment(0, 1, [])
    here = SGLangLauncher(SGLangServerConfig(), run_dir=str(tmp_path / "b"))
    assert here.environment(0, 1, [])["PYTHONPATH"] == "/somewhere/of/ours"
