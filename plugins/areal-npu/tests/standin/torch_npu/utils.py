"""Stand-in ``torch_npu.utils`` (test-only)."""

from __future__ import annotations

import os


def get_cann_version(module: str = "CANN") -> str:
    return os.environ.get(f"AREAL_NPU_STANDIN_{module.upper()}_VERSION", "")
