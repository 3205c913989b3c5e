"""The kernel's admin-token rule and an ASGI guard that enforces it.

Rule (one place, used by every ``SubprocessLauncher``): a server bound to
an address beyond loopback never has open control routes. When any of its
bind hosts is not a loopback address and no token was configured, the
launcher generates one (``admin_token_for``); clients send it as
``Authorization: Bearer <token>`` and the server must refuse requests
without it. Servers bound to loopback only stay open (only this machine can
reach them), unless a token was configured.

How a server enforces the token depends on the backend: the embedded
server checks it itself, SGLang's ``--api-key`` covers every route but its
health/readiness/metrics ones, and ASGI servers that accept extra
middleware by import path (vLLM's ``--middleware``) can load
``AdminTokenMiddleware``, which reads the token from ``ADMIN_TOKEN_ENV``.

No torch and no web framework here: the middleware is imported inside
server processes and speaks plain ASGI.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from areal_kernel.utils.network import is_loopback

# The token's environment variable for ``AdminTokenMiddleware`` (the
# environment, not argv: a command line is world-readable in ``ps``).
ADMIN_TOKEN_ENV = "AREAL_ADMIN_TOKEN"
# Import path of the middleware, for a server's ``--middleware``-style flag.
ADMIN_MIDDLEWARE = "areal_kernel.inference.admin_auth.AdminTokenMiddleware"
# Paths answered without the token: liveness only (schedulers and load
# balancers probe it without credentials; it reveals nothing).
OPEN_PATHS: tuple[str, ...] = ("/health",)

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def admin_token_for(hosts: Iterable[str], configured: str | None = None) -> str | None:
    """The kernel's token rule for servers bound to ``hosts``: ``configured``
    when set; else a fresh random token (43 URL-safe characters) when any
    host is beyond loopback; else ``None`` (open routes, loopback only)."""
    if configured:
        return configured
    if all(is_loopback(h) for h in hosts):
        return None
    return secrets.token_urlsafe(32)


def bearer_header(token: str | None) -> dict[str, str]:
    """The header a client sends with ``token`` (empty without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class AdminTokenMiddleware:
    """Pure ASGI middleware: every HTTP/WebSocket request but ``OPEN_PATHS``
    needs ``Authorization: Bearer <token>`` (401 JSON otherwise; a WebSocket
    is closed with code 1008). The token is ``token`` or, when not given
    (servers that build middleware as ``cls(app)``), ``ADMIN_TOKEN_ENV``."""

    def __init__(self, app: ASGIApp, token: str | None = None, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        token = token or os.environ.get(ADMIN_TOKEN_ENV)
        if not token:
            raise RuntimeError(f"AdminTokenMiddleware needs a token: set {ADMIN_TOKEN_ENV}")
        self.app = app
        self.open_paths = frozenset(open_paths)
        # Compared as digests, in constant time, so timing says nothing about the token.
        self._digest = hashlib.sha256(token.encode()).digest()

    def allowed(self, scope: dict[str, Any]) -> bool:
        """Whether the request in ``scope`` may pass."""
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path in self.open_paths:
            return True
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self._digest)
        return False

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": f"{scope.get('path', '')} needs header 'Authorization: Bearer <admin token>'"})
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
