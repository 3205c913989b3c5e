"""The kernel's scheduler contract pieces that need no running process:
the scheduler's settings section, the token rule for placed servers, and
the placement ``areal plan`` shows."""

from __future__ import annotations

import json

import pytest

from areal_kernel.api.scheduler import Placement
from areal_kernel.config import validate_config
from areal_kernel.plugins import get_registry
from areal_kernel.errors import ConfigError


def test_a_section_for_a_scheduler_that_is_not_selected_names_the_field():
    with pytest.raises(ConfigError, match=r"scheduler\.locl: unknown key.*did you mean 'local'"):
        validate_config({"scheduler": {"type": "local", "locl": {}}}, registry=get_registry())


def test_local_takes_no_settings():
    with pytest.raises(ConfigError, match=r"scheduler\.local: scheduler 'local' takes no settings"):
        validate_config({"scheduler": {"type": "local", "local": {"x": 1}}}, registry=get_registry())


def test_an_unknown_scheduler_type_lists_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"scheduler\.type: no scheduler named 'nope' is registered; registered: .*local"
    ):
        validate_config({"scheduler": {"type": "nope"}}, registry=get_registry())


def test_a_server_placed_beyond_loopback_gets_an_admin_token(tmp_path):
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher

    loopback = EmbeddedLauncher(run_dir=str(tmp_path / "a"))
    loopback.place(None, [Placement("rollout", 0, "n0", "127.0.0.1")])
    assert loopback.admin_token is None and loopback.host_for(0) == "127.0.0.1"
    remote = EmbeddedLauncher(run_dir=str(tmp_path / "b"))
    remote.place(None, [Placement("rollout", 0, "n0", "127.0.0.1"), Placement("rollout", 1, "n1", "10.1.2.3")])
    assert remote.admin_token, "a server bound beyond loopback must guard its control routes"
    # Server i binds its own placement's host, and the command says so.
    cmd = remote.command("/m", 9000, 1, [])
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3" and remote.host_for(0) == "127.0.0.1"
    assert remote.admin_token not in " ".join(cmd)  # the token travels in the environment, not argv


def test_plan_shows_the_local_placement(run_areal):
    proc = run_areal("plan", "/dev/null", "actor.backend=torch:d2", "rollout.backend=embedded:d2", "--json")
    assert proc.returncode == 0, proc.stderr
    placement = json.loads(proc.stdout)["placement"]
    assert placement["scheduler"] == "local"
    for role, n in (("actor", 2), ("rollout", 2)):
        assert [(p["index"], p["node"], p["host"]) for p in placement["roles"][role]] == [
            (i, "local", "127.0.0.1") for i in range(n)
        ]
    human = run_areal("plan", "/dev/null")
    assert "placement by scheduler 'local'" in human.stdout and "node local  host 127.0.0.1" in human.stdout
