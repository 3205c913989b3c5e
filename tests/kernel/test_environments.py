"""Managed environments (``areal_kernel.environments``, kind ``environment``):
a real venv built by ``create`` with a real ``pip install`` of a wheel this
test writes; interpreters probed in their own process; a role's ``python``
setting resolved or refused in one line; this side's packages linked for a
foreign interpreter.

The specs are registered by the test (``Registry.add``) and name a
distribution, ``areal-probe-dist``, that nothing else installs, so each
check can fail: absent, at the wrong version, present."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import zipfile

import pytest

from areal_kernel.errors import ArealError, ConfigError

NAME = "probeenv"
DIST = "areal-probe-dist"


def _wheel(dest: str, version: str) -> str:
    """A minimal, valid wheel of ``areal-probe-dist`` (one module)."""
    stem = f"areal_probe_dist-{version}"
    files = {
        "areal_probe_dist/__init__.py": f"VERSION = {version!r}\n",
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    path = os.path.join(dest, f"{stem}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{stem}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def probe_spec_factory(requirements: tuple[str, ...]):
    from areal_kernel.api.environment import EnvironmentSpec

    def factory(ctx):
        return EnvironmentSpec(
            requirements=requirements, needs=(f"{DIST}>=1.0,<2",), torch_matters=False, description="a test env"
        )

    return factory


@pytest.fixture
def envs(tmp_path, areal_env, monkeypatch):
    """An empty environments root and a registry where ``probeenv`` needs
    ``areal-probe-dist>=1.0,<2`` and installs the wheel ``wheel_version``."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.registry import FactorySpec

    areal_env(AREAL_ENVS_DIR=str(tmp_path / "envs"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()

    def register(wheel_version: str = "1.2") -> None:
        reg = get_registry()
        reg.remove_plugin("testenv")
        globals()["probe_spec"] = probe_spec_factory((f"{DIST} @ file://{_wheel(str(wheels), wheel_version)}",))
        reg.add(FactorySpec(kind="environment", name=NAME, target=f"{__name__}:probe_spec", plugin="testenv"))

    register()
    return register


def _bare_venv(path: str, dist_version: str | None) -> str:
    """A stand-in environment: a venv without pip holding, when asked, only
    the metadata of ``areal-probe-dist`` at ``dist_version`` (what the probe reads)."""
    from areal_kernel.testing.envs import metadata_venv

    return metadata_venv(path, {DIST: dist_version} if dist_version is not None else {})


def test_create_builds_a_venv_with_pip_and_records_it(envs, capsys):
    from areal_kernel import environments as E
    from areal_kernel.cli import main

    python = E.create(NAME)
    said = capsys.readouterr().out
    assert "[1/3]" in said and "[3/3]" in said and f"managed environment '{NAME}' ready" in said
    assert python == E.managed_python(NAME) and os.access(python, os.X_OK)
    # Really installed there by pip (imported in that interpreter), and not here.
    out = subprocess.run(
        [python, "-c", "import areal_probe_dist as m; print(m.VERSION)"], capture_output=True, text=True
    )
    assert out.stdout.strip() == "1.2", out.stderr
    with pytest.raises(ImportError):
        __import__("areal_probe_dist")
    record = json.load(open(os.path.join(E.env_dir(NAME), E.MARKER)))
    assert record["versions"] == {DIST: "1.2"} and record["name"] == NAME
    # A second create keeps what exists; list and check see it.
    with pytest.raises(ArealError, match="exists.*--force"):
        E.create(NAME)
    assert main(["env", "check", NAME]) == 0
    assert f"ok   {NAME}: {python}" in capsys.readouterr().out
    assert main(["env", "list", "--json"]) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out)["environments"] if r["name"] == NAME]
    assert row["state"] == "ready" and row["registered"]
    resolved = E.resolve_python(NAME, NAME, "rollout.x.python")
    assert resolved.python == python and resolved.foreign and resolved.versions[DIST] == "1.2"


def test_create_fails_on_a_spec_pip_cannot_satisfy_and_leaves_no_usable_env(envs, capsys):
    from areal_kernel import environments as E

    envs("0.5")  # installs 0.5, needs >=1.0: built but unusable
    with pytest.raises(ArealError, match=r"lacks areal-probe-dist>=1.0,<2 \(has areal-probe-dist 0.5\)"):
        E.create(NAME)
    assert E.managed_python(NAME) is None
    problems, _ = E.check(NAME)
    assert problems == [
        f"managed environment '{NAME}' is incomplete (an interrupted create); run `areal env create {NAME}`"
    ]
    # `areal doctor` lists it as a problem.
    from areal_kernel.cli import main

    capsys.readouterr()
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environments"] == {NAME: "incomplete"}
    # The same line as `areal env check` (an incomplete create is rebuilt without --force).
    assert problems[0] in report["problems"]


def test_resolve_python_names_the_setting_and_what_is_missing(envs, tmp_path):
    from areal_kernel import environments as E

    where = "rollout.x.python"
    # Unset: this interpreter lacks the distribution and nothing is managed.
    with pytest.raises(ConfigError) as e:
        E.resolve_python(None, NAME, where)
    msg = str(e.value)
    assert msg.startswith(f"{where}: unset") and f"areal env create {NAME}" in msg and "\n" not in msg
    # A path that is not an interpreter.
    with pytest.raises(ConfigError, match=rf"^{where}: '/no/such/python' is not an executable python"):
        E.resolve_python("/no/such/python", NAME, where)
    # A managed name that does not exist.
    with pytest.raises(ConfigError, match=rf"^{where}: no managed environment 'other'.*areal env create other"):
        E.resolve_python("other", NAME, where)
    # An interpreter at the wrong version, then one without it, then a good one (a venv directory works too).
    old = _bare_venv(str(tmp_path / "old"), "0.9")
    with pytest.raises(ConfigError, match=r"lacks areal-probe-dist>=1.0,<2 \(has areal-probe-dist 0.9\)"):
        E.resolve_python(old, NAME, where)
    bare = _bare_venv(str(tmp_path / "bare"), None)
    with pytest.raises(ConfigError, match=r"lacks areal-probe-dist>=1.0,<2 \(not installed\)"):
        E.resolve_python(bare, NAME, where)
    _bare_venv(str(tmp_path / "good"), "1.4")
    good = E.resolve_python(str(tmp_path / "good"), NAME, where)
    assert good.python == str(tmp_path / "good" / "bin" / "python") and good.foreign and good.source == "path"


def test_a_foreign_interpreter_gets_this_sides_packages_linked(envs, tmp_path):
    """What a server in another environment imports of ours: the kernel and
    the named packages always; pluggy and structlog only where it lacks them
    (a bare venv lacks both); then the kernel imports there."""
    from areal_kernel import environments as E

    bare = _bare_venv(str(tmp_path / "bare"), None)
    assert E.missing_packages(bare, ["pluggy", "structlog", "json"]) == ["pluggy", "structlog"]
    staged = E.stage_packages(str(tmp_path / "path"), bare, ["areal_kernel"])
    assert sorted(os.listdir(staged)) == ["areal_kernel", "pluggy", "structlog"]
    assert os.path.realpath(os.path.join(staged, "areal_kernel")) == os.path.dirname(
        os.path.realpath(__import__("areal_kernel").__file__)
    )
    # Linked only: this interpreter imports it from where it is, the stage is a symlink.
    assert os.path.islink(os.path.join(staged, "areal_kernel"))
    out = subprocess.run(
        [bare, "-c", "import areal_kernel.errors, pluggy; print(areal_kernel.__version__)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": staged},
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == __import__("areal_kernel").__version__, out.stderr
    # Without the stage the same import fails there (the control).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run([bare, "-c", "import areal_kernel"], capture_output=True, env=env).returncode != 0


def test_torch_mismatch_is_said_and_equal_public_versions_match():
    from areal_kernel import environments as E

    ours = E._local_versions(["torch"])["torch"]
    assert ours is not None
    assert E.torch_mismatch({"torch": ours.split("+")[0] + "+other"}) is None
    why = E.torch_mismatch({"torch": "1.0.0"})
    assert why is not None and "torch 1.0.0 there" in why and ours in why


def test_a_spec_with_unparsable_requirements_is_named_at_build(areal_env):
    from areal_kernel.api.environment import EnvironmentContext, EnvironmentSpec
    from areal_kernel.api.kinds import PluginContractError
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.registry import FactorySpec

    areal_env()
    globals()["bad_spec"] = lambda ctx: EnvironmentSpec(requirements=("vllm===",), needs=("x>=1",))
    globals()["not_a_spec"] = lambda ctx: {"requirements": []}
    reg = get_registry()
    reg.add(FactorySpec(kind="environment", name="bad", target=f"{__name__}:bad_spec", plugin="testenv"))
    reg.add(FactorySpec(kind="environment", name="notspec", target=f"{__name__}:not_a_spec", plugin="testenv"))
    with pytest.raises(PluginContractError, match=r"environment 'bad' \(plugin 'testenv'\): unusable requirement"):
        reg.build("environment", "bad", EnvironmentContext("bad", "cpu"))
    with pytest.raises(PluginContractError, match=r"returned dict for platform 'cpu'.*EnvironmentSpec"):
        reg.build("environment", "notspec", EnvironmentContext("notspec", "cpu"))
