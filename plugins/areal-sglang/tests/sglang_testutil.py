"""Helpers shared by the areal-sglang tests (a uniquely named module: every
test directory of the repo has its own conftest.py)."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "sglang_standin.py"


STANDIN_PREFIX = [sys.executable, str(STANDIN)]


def post_json(url: str, obj: Any, timeout: float = 60) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(obj).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def make_model_dir(path: Path, seed: int) -> str:
    """A directory the stand-in can "load": it hashes the weight files, so
    different bytes mean different outputs."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 256}))
    (path / "model.safetensors").write_bytes(os.urandom(8) + seed.to_bytes(8, "little"))
    return str(path)


def standin_state(address: str, api_key: str | None = None) -> dict:
    req = urllib.request.Request(f"http://{address}/_standin/state")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def wait_for_tokens(address: str, n_requests: int, min_tokens: int, timeout: float = 60) -> None:
    """Block until ``n_requests`` requests run on the stand-in, each with at least
    ``min_tokens`` tokens (so a pause or kill lands mid-generation, whatever the load)."""
    deadline = time.monotonic() + timeout
    while True:
        toks = standin_state(address)["running_tokens"]
        if len(toks) >= n_requests and all(t >= min_tokens for t in toks):
            return
        assert time.monotonic() < deadline, f"stand-in {address}: running tokens {toks}"
        time.sleep(0.01)
