"""Safe defaults: servers bind loopback unless told otherwise, control routes
need an admin token beyond loopback (real server processes), weights never
travel as pickles."""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _post(address: str, path: str, body: dict, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://{address}{path}", json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_defaults_bind_loopback_without_token():
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.inference.embedded.server import parse_args

    assert EmbeddedServerConfig().host == "127.0.0.1"
    assert parse_args(["--model", "m", "--port", "1"]).host == "127.0.0.1"
    cfg = load_config(None, [], registry=get_registry())
    assert (cfg.rollout.plugin_config or EmbeddedServerConfig()).host == "127.0.0.1"
    launcher = EmbeddedLauncher(EmbeddedServerConfig(), run_dir=None)
    assert launcher.admin_token is None  # loopback: nobody else can reach the routes


def test_launcher_generates_a_token_beyond_loopback(tmp_path):
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    a = EmbeddedLauncher(EmbeddedServerConfig(host="0.0.0.0"), run_dir=str(tmp_path / "a"))
    b = EmbeddedLauncher(EmbeddedServerConfig(host="0.0.0.0"), run_dir=str(tmp_path / "b"))
    assert a.admin_token and b.admin_token and a.admin_token != b.admin_token and len(a.admin_token) >= 32
    # ... handed to the server through the environment, never argv (visible in ps).
    assert a.environment(0, 1, [])["AREAL_EMBEDDED_ADMIN_TOKEN"] == a.admin_token
    assert a.admin_token not in " ".join(a.command("m", 1, 0, []))
    fixed = EmbeddedLauncher(EmbeddedServerConfig(host="0.0.0.0", admin_token="mine"), run_dir=str(tmp_path / "c"))
    assert fixed.admin_token == "mine"


def test_server_refuses_to_bind_beyond_loopback_without_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AREAL_EMBEDDED_ADMIN_TOKEN"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_kernel.inference.embedded.server", "--model", str(tmp_path),
         "--host", "127.0.0.2", "--port", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert "--host 127.0.0.2 is not a loopback address" in proc.stderr and "--admin-token" in proc.stderr


@pytest.mark.slow
def test_control_routes_need_the_token_generation_stays_open(tmp_path):
    """A real server on 127.0.0.2 (not one of the loopback names, so it is
    treated as reachable by others, yet nothing outside this machine can
    connect) launched through the embedded backend, as a run does."""
    from areal_kernel.api.engine import WeightUpdateMeta
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.inference.embedded.backend import EmbeddedBackend
    from areal_kernel.testing.models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    cfg = load_config(None, ["rollout.embedded.host=127.0.0.2", "rollout.embedded.startup_timeout_s=300"], registry=get_registry())
    backend = EmbeddedBackend(cfg)
    try:
        (address,) = backend.launch(model, [[]], str(tmp_path / "run"))
        assert address.startswith("127.0.0.2:")
        token = backend.launcher.admin_token
        assert token
        for route, body in [("/pause", {"mode": "abort"}), ("/resume", {}), ("/set_version", {"version": 3}),
                            ("/update_weights_from_disk", {"path": model, "version": 3}), ("/abort", {"rid": "x"})]:
            assert _post(address, route, body) == 401, route
            assert _post(address, route, body, token="wrong-" + token) == 401, route
        gen = {"rid": "open", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "greedy": True}}
        assert _post(address, "/generate", gen) == 200  # generation needs no token
        # The client the backend builds sends the token: control calls succeed.
        client = backend.make_client([address])
        client.pause()
        client.resume()
        client.update_weights(WeightUpdateMeta(kind="disk", path=model, version=1))
        with urllib.request.urlopen(f"http://{address}/info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == 1
        client.destroy()
    finally:
        backend.stop()


# -- no pickles ------------------------------------------------------------------

_TORCH_LOAD = re.compile(r"torch\.load\(")


def test_no_torch_load_without_weights_only():
    """Every ``torch.load`` call in the kernel and plugins passes
    ``weights_only=True`` (pickle-free), and nothing sets it to False."""
    offenders = []
    for path in list((REPO / "areal_kernel").rglob("*.py")) + list((REPO / "plugins").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "weights_only=False" in text.replace(" ", ""):
            offenders.append(f"{path}: weights_only=False")
        for m in _TORCH_LOAD.finditer(text):
            call = text[m.start(): text.find(")", m.end()) + 1]
            if "weights_only=True" not in call.replace(" ", ""):
                offenders.append(f"{path}: {call}")
    assert not offenders, offenders


class _Boom:
    """A pickle that runs code when loaded: the attack a pickled checkpoint allows."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_disk_weight_loader_reads_only_safetensors(tmp_path):
    from areal_kernel.errors import DataError
    from areal_kernel.weights.disk import load_state_dict_dir

    marker = tmp_path / "pwned"
    only_pickle = tmp_path / "pickled"
    only_pickle.mkdir()
    (only_pickle / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(DataError, match=r"holds no \*\.safetensors file"):
        load_state_dict_dir(str(only_pickle))
    disguised = tmp_path / "disguised"
    disguised.mkdir()
    (disguised / "model.safetensors").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(Exception):
        load_state_dict_dir(str(disguised))
    assert not marker.exists()  # the payload never ran
