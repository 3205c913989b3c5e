"""Agents for the workflow tests (loaded by file path, as users may)."""
from __future__ import annotations

import json
import urllib.request
from typing import Any

CALLS: list[str] = []


def _ask(base_url: str, api_key: str, text: str) -> dict:
    req = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps({"model": "areal", "messages": [{"role": "user", "content": text}]}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


class FailsOnOddSessions:
    """Asks once; the sessions whose record index is odd then raise."""

    n = 0

    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> float:
        import asyncio

        FailsOnOddSessions.n += 1
        mine = FailsOnOddSessions.n
        await asyncio.to_thread(_ask, base_url, api_key, record["prompt"])
        if mine % 2 == 0:
            raise RuntimeError("the environment broke")
        return 0.5


class AlwaysFails:
    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> float:
        raise ValueError("no luck")


class ReturnsText:
    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> Any:
        return "one"


class LeaksItsClient:
    """Follows the contract but never closes its ``openai`` client, and leaves
    a task running: what a newcomer's agent does. Half the clients are kept
    referenced until the process exits (their connections stay open unless
    the kernel closes them), half are dropped to the garbage collector (the
    client's own finaliser then closes it on whatever loop runs at the time).

    Each run first collects garbage itself: the finalisers of earlier
    sessions' dropped clients run now, on the loop this run is on. In the
    final evaluation that is another loop than the rollout loop the clients
    ran on, which is what a large run's collector does sooner or later by
    itself (it printed one traceback per session); here it happens every
    time. At exit the process prints what was left: open sockets to the
    proxy, and how many of the leftover tasks were cancelled."""

    kept: list[Any] = []
    tasks_started = 0
    tasks_cancelled = 0
    proxy_port: int | None = None

    def __init__(self) -> None:
        import atexit

        atexit.register(LeaksItsClient.report)

    @staticmethod
    def report() -> None:
        import gc
        import socket

        open_sockets = 0
        for obj in gc.get_objects():
            if isinstance(obj, socket.socket) and obj.fileno() != -1:
                try:
                    if obj.getpeername()[1] == LeaksItsClient.proxy_port:
                        open_sockets += 1
                except OSError:
                    pass
        print(f"LEAK-REPORT kept_clients={len(LeaksItsClient.kept)} open_sockets_to_proxy={open_sockets} "
              f"tasks_started={LeaksItsClient.tasks_started} tasks_cancelled={LeaksItsClient.tasks_cancelled}",
              flush=True)  # fmt: skip

    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> float:
        import asyncio
        import gc
        from urllib.parse import urlparse

        from openai import AsyncOpenAI

        gc.collect()
        LeaksItsClient.proxy_port = urlparse(base_url).port
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = await client.chat.completions.create(
            model="areal", messages=[{"role": "user", "content": str(record["prompt"])}]
        )
        if len(LeaksItsClient.kept) <= LeaksItsClient.tasks_started // 2:
            LeaksItsClient.kept.append(client)

        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                LeaksItsClient.tasks_cancelled += 1
                raise

        LeaksItsClient.tasks_started += 1
        asyncio.get_running_loop().create_task(forever())  # never awaited, never cancelled by the agent
        return float(len(reply.choices[0].message.content or "") % 2)
