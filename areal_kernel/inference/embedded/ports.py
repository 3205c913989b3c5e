"""Free TCP ports (no torch): the one implementation lives in
``areal_kernel.utils.network``; this name is kept for existing imports."""

from __future__ import annotations

from areal_kernel.utils.network import find_free_port

__all__ = ["find_free_port"]
