"""Whether this environment has torch_npu, answered without importing it:
the registration hook's probe and the platform class both ask (the probe
without importing the platform module)."""

from __future__ import annotations

import importlib.util


def torch_npu_installed() -> bool:
    """Whether a ``torch_npu`` module can be found, without importing it."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):  # a broken or half-imported entry counts as absent
        return False
