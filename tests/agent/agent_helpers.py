"""Helpers the agent tests import (a module of its own: every test directory
has a ``conftest`` module, so helpers imported by that name would collide
when the whole suite runs in one process)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class Recorder:
    """The real inference client, with every (request, response) kept."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[Any, Any]] = []

    async def agenerate(self, req: Any) -> Any:
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


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
