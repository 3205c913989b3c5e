"""What a test needs to show that a workflow trains on exactly what the
inference engine generated: the real engine with every call kept
(``RecordingEngine``) and the responses inside a trajectory
(``loss_spans``: each run of loss tokens is one engine response)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["RecordingEngine", "loss_spans"]


class RecordingEngine:
    """The real inference engine, with every (request, response) of
    ``agenerate`` kept in ``calls``; anything else goes to ``engine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[Any, Any]] = []

    async def agenerate(self, req: Any) -> Any:
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def loss_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(start, end)`` slices of each run of 1s in ``loss_mask``."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
