"""Stand-in ``torch_npu._C._distributed_c10d`` (test-only): ``ProcessGroupHCCL``
is a gloo process group on the same store, i.e. collectives on the host."""

from __future__ import annotations

import datetime
from typing import Any

created: list[dict[str, Any]] = []


class ProcessGroupHCCL:
    class Options:
        def __init__(self) -> None:
            self._timeout = datetime.timedelta(minutes=30)
            self.is_high_priority_stream = False

    def __new__(cls, store: Any, rank: int, size: int, options: "ProcessGroupHCCL.Options") -> Any:  # type: ignore[misc]
        import torch.distributed as dist

        created.append({"rank": rank, "size": size, "timeout": options._timeout})
        return dist.ProcessGroupGloo(store, rank, size, options._timeout)
