"""Allocation strings: ``fsdp:d2``, ``vllm:d2t1``, ``megatron:d2t2p2``.

The familiar AReaL form, but open: the part before ``:`` is any registered
backend name; the dims after it say how many processes/devices it spans.
Dimensions: d (data parallel / replicas), t (tensor), p (pipeline),
c (context), e (expert). Omitted dims are 1.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from areal_kernel.errors import ConfigError

DIMS = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_DIM = re.compile(r"([a-z])(\d+)")


class AllocationError(ValueError):
    pass


class Allocation(BaseModel):
    model_config = ConfigDict(frozen=True)

    backend: str
    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1

    @property
    def world_size(self) -> int:
        """Processes (one device each) for a train engine: d*t*p*c (experts reuse them)."""
        return self.d * self.t * self.p * self.c

    @property
    def devices_per_replica(self) -> int:
        """Devices of one inference server: t*p*c."""
        return self.t * self.p * self.c

    def dims_text(self) -> str:
        return "".join(f"{k}{getattr(self, k)}" for k in DIMS if getattr(self, k) != 1) or "d1"

    def __str__(self) -> str:
        return f"{self.backend}:{self.dims_text()}"


def parse_allocation(text: str) -> Allocation:
    """Parse ``name[:dims]``; raises ``AllocationError`` saying what is valid."""
    if not isinstance(text, str) or not text.strip():
        raise AllocationError("backend must be a non-empty string like 'torch', 'fsdp:d2' or 'vllm:d2t1'")
    name, sep, dims = text.strip().partition(":")
    if not _NAME.match(name):
        raise AllocationError(f"backend name {name!r} is not valid; expected letters, digits, '_', '-' or '.'")
    values: dict[str, int] = {}
    if sep:
        if not dims:
            raise AllocationError(f"{text!r}: nothing after ':'; expected dims like 'd2' or 'd2t1'")
        pos = 0
        for m in _DIM.finditer(dims):
            if m.start() != pos:
                break
            key, num = m.group(1), int(m.group(2))
            if key not in DIMS:
                raise AllocationError(
                    f"{text!r}: unknown dimension '{key}'; valid: " + ", ".join(f"{k} ({v})" for k, v in DIMS.items())
                )
            if key in values:
                raise AllocationError(f"{text!r}: dimension '{key}' given twice")
            if num < 1:
                raise AllocationError(f"{text!r}: dimension '{key}' must be >= 1, got {num}")
            values[key] = num
            pos = m.end()
        if pos != len(dims):
            raise AllocationError(
                f"{text!r}: cannot parse {dims[pos:]!r}; expected a sequence like 'd2', 'd2t1' or 'd4t2p1'"
            )
    return Allocation(backend=name, **values)


def allocation_at(value: "Allocation | str", where: str) -> Allocation:
    """``value`` as an ``Allocation`` (parsed when a string): what an engine's
    layout code starts from; one ``ConfigError`` naming ``where`` (the config
    field) when it does not parse."""
    if isinstance(value, Allocation):
        return value
    try:
        return parse_allocation(value)
    except AllocationError as e:
        raise ConfigError(f"{where}: {e}") from None
