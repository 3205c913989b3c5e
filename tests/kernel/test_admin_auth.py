"""The kernel's admin-token rule (``admin_token_for``) and the ASGI guard
(``AdminTokenMiddleware``) servers load to enforce it, run on real ASGI
messages in-process (the inner app is a minimal real ASGI callable)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from areal_kernel.inference.admin_auth import ADMIN_TOKEN_ENV, AdminTokenMiddleware, admin_token_for


def test_token_rule_for_non_loopback_binds():
    assert admin_token_for(["127.0.0.1", "localhost", "::1"]) is None
    assert admin_token_for(["127.0.0.1"], "mine") == "mine"
    a, b = admin_token_for(["127.0.0.1", "10.0.0.2"]), admin_token_for(["0.0.0.0"])
    assert a and b and a != b and len(a) >= 32
    assert admin_token_for(["10.0.0.2"], "mine") == "mine"


def _call(path: str, auth: str | None = None, kind: str = "http") -> tuple[list, list]:
    reached: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(msg: dict) -> None:
        sent.append(msg)

    headers = [(b"host", b"x")] + ([(b"authorization", auth.encode())] if auth else [])
    scope = {"type": kind, "path": path, "method": "POST", "headers": headers, "root_path": ""}
    # Built as a server builds extra middleware, cls(app): the token comes from the environment.
    asyncio.run(AdminTokenMiddleware(app)(scope, receive, send))
    return reached, sent


def test_middleware_guards_every_path_but_health(monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "t0ken")

    assert _call("/health") == (["/health"], [])
    for path in ("/pause", "/collective_rpc", "/update_weights", "/v1/completions", "/metrics"):
        for auth in (None, "Bearer wrong", "Basic t0ken", "t0ken"):
            reached, sent = _call(path, auth)
            assert reached == [] and sent[0]["status"] == 401, (path, auth)
            assert path in json.loads(sent[1]["body"])["error"]
        assert _call(path, "Bearer t0ken") == ([path], [])
        assert _call(path, "bearer t0ken")[0] == [path]
    reached, sent = _call("/ws", kind="websocket")
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
    lifespan_reached, _ = _call("", kind="lifespan")
    assert lifespan_reached == [""]


def test_middleware_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=ADMIN_TOKEN_ENV):
        AdminTokenMiddleware(lambda *a: None)  # type: ignore[arg-type,return-value]
