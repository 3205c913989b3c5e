"""A real inference server for a test: the kernel's embedded server on a
(tiny) model and a client of it, started and stopped as one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["embedded_server"]


@contextmanager
def embedded_server(model_dir: str, run_dir: str) -> Iterator[Any]:
    """One embedded server (fp32, on the cpu) on ``model_dir``, logging under
    ``run_dir``; yields a ``RemoteInferenceEngine`` of it. On exit the client
    is destroyed and the server stopped."""
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=run_dir)
    try:
        infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
        engine = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
        try:
            yield engine
        finally:
            engine.destroy()
    finally:
        launcher.stop()
