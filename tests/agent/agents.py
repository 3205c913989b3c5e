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
