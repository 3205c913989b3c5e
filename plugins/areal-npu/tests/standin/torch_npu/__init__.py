"""TEST-ONLY STAND-IN for Ascend's ``torch_npu``. It is NOT torch_npu.

Real torch_npu cannot be installed here (it breaks ``import torch`` without
Ascend's libraries), so areal-npu's tests put this directory on the path
instead. It offers the part of torch_npu's interface that areal-npu uses,
computing on the host:

- ``torch_npu.npu``: device count (``AREAL_NPU_STANDIN_DEVICES``, default 8),
  current/set device, synchronize, memory figures, cache release, seeding and
  RNG state, device properties; every call is recorded in ``npu.calls`` so a
  test can see that the platform went through it;
- the device name ``npu`` (torch's privateuse1 backend renamed, as torch_npu
  does); tensors asked for on ``npu`` are made on the host instead (a torch
  function mode rewrites the device argument);
- ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``: a gloo process group
  over the same store (host collectives);
- the ``hccl`` backend registered with torch.distributed (for ``npu`` and
  ``cpu`` tensors: host compute hands it ``cpu`` ones);
- ``torch_npu.utils.get_cann_version`` answering from
  ``AREAL_NPU_STANDIN_<MODULE>_VERSION`` ("" when unset, like old torch_npu).

Importing it changes torch for the rest of the process (torch cannot rename
its privateuse1 device back), so tests import it only in processes of their
own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torch_npu import _C, npu, utils

__version__ = "2.13.0+areal.standin"
__all__ = ["_C", "npu", "utils", "activate", "HostCompute"]


def _host(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "npu":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "npu":
        return "cpu"
    return value


class HostCompute(TorchFunctionMode):
    """Runs every torch call whose device argument names ``npu`` on the host.
    Torch function modes are per thread: ``activate`` enters one in the
    importing thread; another thread enters its own (``with HostCompute():``)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = {k: _host(v) for k, v in (kwargs or {}).items()}
        return func(*(_host(a) for a in args), **kwargs)


_mode: HostCompute | None = None
_hccl_registered = False


def _register_hccl() -> None:
    global _hccl_registered
    if _hccl_registered:
        return
    import torch.distributed as dist

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        opts = _C._distributed_c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return _C._distributed_c10d.ProcessGroupHCCL(store, rank, size, opts)

    # Host compute hands hccl cpu tensors, so the group must take them too.
    dist.Backend.register_backend("hccl", create, devices=["npu", "cpu"])
    _hccl_registered = True


def activate() -> None:
    global _mode
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    torch.npu = npu  # type: ignore[attr-defined]  (what torch_npu does on import)
    if _mode is None:
        _mode = HostCompute()
        _mode.__enter__()
    _register_hccl()


activate()
