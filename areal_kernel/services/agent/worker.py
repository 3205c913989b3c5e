"""One worker of the ``areal agent`` service.

``python -m areal_kernel.services.agent.worker --index I --control URL``,
started by the service with ``AREAL_AGENT_WORKER_TOKEN`` set. It loads the
agent class the service names (``GET /work/agent``), then loops: take a
record and a proxy session (``POST /work/next``), run
``agent.run(record, base_url=..., api_key=...)`` under the session's time
limit, report the reward or the error (``POST /work/done``). One session at
a time; a worker that dies is restarted by the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from areal_kernel.services.agent.spec import WORKER_TOKEN_ENV
from areal_kernel.utils import aio


class Control:
    def __init__(self, url: str, token: str, index: int) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.index = index

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.url + path, method=method, data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")


async def run(control: Control) -> None:
    from areal_kernel.agent.workflow import load_agent_class

    status, spec = await asyncio.to_thread(control.call, "GET", "/work/agent")
    if status != 200:
        raise SystemExit(f"worker {control.index}: the service refused its agent settings (HTTP {status}: {spec})")
    agent = load_agent_class(spec["agent"])(**spec["agent_kwargs"])
    print(f"worker {control.index}: running {spec['agent']}", flush=True)
    while True:
        status, work = await asyncio.to_thread(control.call, "POST", "/work/next", {"worker": control.index})
        if status == 204 or work is None:
            await asyncio.sleep(0.2)
            continue
        if status != 200:
            raise SystemExit(f"worker {control.index}: /work/next answered HTTP {status}: {work}")
        reward: float | None = None
        error: str | None = None
        try:
            # Tasks the agent leaves running end with its session (areal_kernel.utils.aio).
            async with aio.scope(f"agent session {work['session_id']}"):
                out = await asyncio.wait_for(
                    agent.run(dict(work["record"]), base_url=work["base_url"], api_key=work["api_key"]),
                    work["timeout_s"],
                )
            if out is not None:
                if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
                    raise ValueError(f"run() returned {out!r}; expected a finite number or None")
                reward = float(out)
        except asyncio.TimeoutError:
            error = f"agent timed out after {work['timeout_s']:g} s"
        except Exception as e:  # the session is reported failed; the worker goes on
            error = f"agent raised {type(e).__name__}: {e}"
        if error:
            print(f"worker {control.index}: session {work['session_id']}: {error}", flush=True)
        body = {"worker": control.index, "session_id": work["session_id"], "reward": reward, "error": error}
        await asyncio.to_thread(control.call, "POST", "/work/done", body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m areal_kernel.services.agent.worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--control", required=True, help="the service's control URL")
    args = p.parse_args(argv)
    token = os.environ.pop(WORKER_TOKEN_ENV, "")
    # The agent's module may live next to where `areal agent run` ran (the service starts us there).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    aio.run(run(Control(args.control, token, args.index)), f"agent worker {args.index}")


if __name__ == "__main__":
    main()
