"""One structlog setup for every process: readable on a terminal, JSON when asked.

``setup_logging()`` is called by the CLI and by worker processes; library code
only calls ``get_logger(__name__)``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


class _CurrentStderr:
    """A file that is always the current ``sys.stderr``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_CURRENT_STDERR = _CurrentStderr()


def setup_logging(level: str | None = None, json_logs: bool | None = None, stream: Any = None) -> None:
    """Configure structlog + stdlib logging. ``AREAL_LOG_JSON=1`` and
    ``AREAL_LOG_LEVEL`` are read when arguments are not given, so child
    processes inherit the controller's choice through the environment."""
    global _configured
    level = (level or os.environ.get("AREAL_LOG_LEVEL") or "info").upper()
    if json_logs is None:
        json_logs = os.environ.get("AREAL_LOG_JSON", "").lower() in {"1", "true", "yes"}
    # Not bound to today's sys.stderr: whoever swaps it later (a test's
    # capture, an embedding application) would leave the logs writing to a
    # closed file; the proxy writes to the sys.stderr of the moment.
    stream = stream or _CURRENT_STDERR
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=stream.isatty() if hasattr(stream, "isatty") else False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if json_logs else "%H:%M:%S"),
            structlog.processors.format_exc_info if json_logs else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level, stream=stream, format="%(levelname)s %(name)s: %(message)s", force=True)
    # HTTP clients log every request at INFO (the openai client's httpx: one
    # line per agent turn); their warnings still show.
    noisy_loggers = ("urllib3", "filelock", "datasets", "aiohttp.access", "asyncio", "httpx", "httpx2", "httpcore",
                     "httpcore2", "openai")  # fmt: skip
    for noisy in noisy_loggers:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    _configured = True


def get_logger(name: str | None = None, **bound: Any) -> Any:
    if not _configured:
        setup_logging()
    log = structlog.get_logger(name)
    return log.bind(**bound) if bound else log
