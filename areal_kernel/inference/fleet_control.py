"""The running job's fleet control route, and the client ``areal fleet`` uses.

A run with inference servers answers, on the controller, at
``http://127.0.0.1:<free port>``:

- ``GET  /fleet/status``                     -> ``Fleet.status()``
- ``POST /fleet/add    {"address": "h:p"}``  -> ``Fleet.request_add``
- ``POST /fleet/drain  {"address": "h:p"}``  -> ``Fleet.request_drain``

every call with ``Authorization: Bearer <token>``. The token is made per run
and written with the URL to ``<run_dir>/fleet.json`` (mode 0600): whoever
can read the run directory may change its fleet, nobody else. Errors answer
``{"error": "<one line>"}`` with a 4xx status and the run goes on. The route
binds loopback: commands come from the controller's machine.

Why the standard library's threaded HTTP server: the requests are rare and
small, they must be served while the trainer's thread is busy (a step, a
weight update), and the controller's event loops belong to rollout.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
import http.client
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from areal_kernel.errors import ArealError
from areal_kernel.inference.fleet import Fleet, FleetError
from areal_kernel.logging import get_logger

log = get_logger(__name__)

CONTROL_FILE = "fleet.json"
TOKEN_ENV = "AREAL_FLEET_TOKEN"


class FleetControl:
    """The control route of ``fleet`` for the run in ``run_dir`` (started at
    once; ``close()`` stops it and removes ``fleet.json``)."""

    def __init__(self, fleet: Fleet, run_dir: str, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.fleet = fleet
        self.path = os.path.join(run_dir, CONTROL_FILE)
        self.token = token or secrets.token_urlsafe(24)
        control = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
                return  # the fleet logs what it does; no per-request lines

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _authorized(self) -> bool:
                got = self.headers.get("Authorization", "")
                ok = got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), control.token.encode())
                if not ok:
                    self._answer(
                        401,
                        {"error": f"needs 'Authorization: Bearer <the run's token>' (the token is in {control.path})"},
                    )
                return ok

            def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's name)
                if not self._authorized():
                    return
                if self.path != "/fleet/status":
                    self._answer(
                        404, {"error": f"no route {self.path}; routes: /fleet/status, /fleet/add, /fleet/drain"}
                    )
                    return
                self._answer(200, control.fleet.status())

            def do_POST(self) -> None:  # noqa: N802
                if not self._authorized():
                    return
                actions: dict[str, Callable[[Any], dict[str, Any]]] = {
                    "/fleet/add": control.fleet.request_add,
                    "/fleet/drain": control.fleet.request_drain,
                }
                action = actions.get(self.path)
                if action is None:
                    self._answer(
                        404, {"error": f"no route {self.path}; routes: /fleet/status, /fleet/add, /fleet/drain"}
                    )
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except ValueError as e:
                    self._answer(400, {"error": f'{self.path}: unreadable body ({e}); send {{"address": "host:port"}}'})
                    return
                try:
                    self._answer(200, action(body.get("address")))
                except FleetError as e:
                    self._answer(e.status, {"error": str(e)})
                except Exception as e:  # a bug must not end the run: say it, go on
                    log.warning("fleet control request failed", route=self.path, error=repr(e))
                    self._answer(500, {"error": f"{type(e).__name__}: {e}"})

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="areal-fleet-control", daemon=True)
        self._thread.start()
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid()}, f)
        os.replace(tmp, self.path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        try:
            os.remove(self.path)
        except OSError:
            pass


# -- the client side (``areal fleet``) ---------------------------------------------------


def _control_file(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, CONTROL_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ArealError(
            f"{run_dir}: no running job there ({CONTROL_FILE} is missing: the run has ended, has not started its "
            "servers yet, or runs several policies, which keep a fixed fleet)"
        ) from None
    except (OSError, ValueError) as e:
        raise ArealError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        raise ArealError(f"{path}: not a fleet control file (no 'url')")
    return data


def call(run_dir: str, method: str, route: str, body: dict[str, Any] | None = None, token: str | None = None) -> Any:
    """One request to the run's control route; the reply's JSON, or an
    ``ArealError`` with the run's one-line answer."""
    data = _control_file(run_dir)
    token = token or os.environ.get(TOKEN_ENV) or data.get("token") or ""
    raw = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        data["url"] + route,
        data=raw,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error")
        except ValueError:
            msg = None
        raise ArealError(msg or f"the run answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ArealError(
            f"{run_dir}: the run does not answer at {data['url']} ({getattr(e, 'reason', e)}); "
            f"is it still running (pid {data.get('pid')})?"
        ) from None
