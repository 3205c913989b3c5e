"""Helpers the agent tests import (a module of its own: every test directory
has a ``conftest`` module, so helpers imported by that name would collide
when the whole suite runs in one process)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from areal_kernel.testing.recording import RecordingEngine


# The kernel's recording engine, under the name these tests use.
Recorder = RecordingEngine


def http(method: str, url: str, body: Any = None, key: str | None = None, raw: bytes | None = None) -> tuple[int, Any]:
    """One JSON request; (status, parsed body)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if method == "POST" and data is None:
        data = b""
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
