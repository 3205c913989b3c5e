"""Stand-in ``torch_npu._C`` (test-only)."""

from torch_npu._C import _distributed_c10d

__all__ = ["_distributed_c10d"]
