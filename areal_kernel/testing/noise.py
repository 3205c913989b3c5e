"""Float comparisons across code paths, against a noise floor measured in the
same test.

Two code paths that compute the same thing (two FSDP ranks and one process, a
Megatron layout and the torch engine, a server and the train engine) sum the
same numbers in another order. How far apart that lands depends on the CPU's
float path (AVX2 and AVX-512 differ by 2-3x, and training steps amplify it),
so a constant tolerance either hides bugs or fails on the other kind of
machine. Instead, measure the noise in the same test: run the *reference*
again through a path that only changes the summation order (another
micro-batch split, another attention kernel), and require the path under test
to land within a stated ``multiple`` of that floor::

    floor = measure_noise_floor("logprobs", ref_lp, ref_lp_other_split)
    assert_within_noise(fsdp_lp, ref_lp, floor, multiple=4.0)

A failure prints the difference, where its maximum is, both values there, the
floor (and what it was measured on) and the multiple.

When the floor measures exactly zero (the two reference runs happened to sum
in the same order, or the quantity is exact, like a learning rate), the floor
is bounded below by ``ulps`` units in the last place of the compared
magnitudes: ``ulps * eps(dtype) * max|ref|`` for an absolute comparison, and
per element ``ulps * eps(dtype) * |ref| / max(1, |ref|)`` for a relative one.
That is the smallest difference two float computations of the value can be
expected to show at all, so the multiple then allows a few ulps, not zero.

Quantities that differ in how noise grows (a loss, a gradient norm, per-token
logprobs, entropies, weights after several optimizer steps) each get their own
floor. Values: numbers, (nested) sequences of numbers, tensors, and mappings
of name -> any of these (the key sets must be equal).

This module does not import torch unless it is handed a tensor.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_ULPS",
    "Comparison",
    "Difference",
    "NoiseFloor",
    "assert_within_noise",
    "max_difference",
    "measure_noise_floor",
    "sum_rounding",
]

# Machine epsilon of the dtypes the engines compute in (2**-23, 2**-7, 2**-10, 2**-52).
_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10, "float64": 2.0**-52}
# 4 ulps: one rounding in each of a product, a sum, an exp/log and a final
# cast; a reordered reduction over n terms differs by more (~sqrt(n) ulps),
# and that is what a non-zero measured floor then records.
DEFAULT_ULPS = 4.0


@dataclass(frozen=True)
class Difference:
    """The largest element-wise difference between two values."""

    value: float  # max |a - b| (relative: |a - b| / max(1, |b|))
    where: str  # the key/index of that maximum
    a: float  # a there
    b: float  # b there
    scale: float  # max |b| over all elements (absolute) or max |b| / max(1, |b|) (relative)
    count: int  # elements compared
    relative: bool

    def __str__(self) -> str:
        kind = "relative |a-b|/max(1,|b|)" if self.relative else "|a-b|"
        return f"max {kind} = {self.value:.3g} at {self.where} (a={self.a!r}, b={self.b!r}; {self.count} elements)"


@dataclass(frozen=True)
class NoiseFloor:
    """The noise of the reference path against itself, for one quantity."""

    what: str
    measured: Difference  # the reference against its same-path alternative
    lower_bound: float  # ulps * eps(dtype) * scale: stands in when ``measured`` is ~0
    dtype: str
    ulps: float

    @property
    def value(self) -> float:
        return max(self.measured.value, self.lower_bound)

    @property
    def relative(self) -> bool:
        return self.measured.relative

    def __str__(self) -> str:
        return (
            f"noise floor {self.value:.3g} for {self.what} (measured: reference vs its same-path alternative, "
            f"{self.measured}; lower bound {self.lower_bound:.3g}: {self.ulps:g} ulps of {self.dtype} x scale "
            f"{self.measured.scale:.3g}, or a derived rounding bound where larger)"
        )


@dataclass(frozen=True)
class Comparison:
    """A passed comparison: what the test may print or record."""

    what: str
    diff: Difference
    floor: NoiseFloor
    multiple: float

    @property
    def ratio(self) -> float:
        """The difference in units of the floor."""
        if self.diff.value == 0.0:
            return 0.0
        return self.diff.value / self.floor.value if self.floor.value > 0 else math.inf

    def __str__(self) -> str:
        return f"{self.what}: diff {self.diff.value:.3g} = {self.ratio:.2f} x floor {self.floor.value:.3g}"


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _elements(a: Any, b: Any, path: str, relative: bool, out: list[Difference]) -> None:
    """Append one ``Difference`` per leaf (number or tensor) of ``a`` vs ``b``."""
    if _is_tensor(a) or _is_tensor(b):
        _tensor_diff(a, b, path, relative, out)
    elif isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            raise AssertionError(
                f"{path or 'value'}: a mapping compared with {type(b if isinstance(a, Mapping) else a)}"
            )
        if set(a) != set(b):
            raise AssertionError(
                f"{path or 'value'}: different keys: only in a {sorted(set(a) - set(b))[:5]}, "
                f"only in b {sorted(set(b) - set(a))[:5]}"
            )
        for k in sorted(a):
            _elements(a[k], b[k], f"{path}[{k!r}]", relative, out)
    elif isinstance(a, Sequence) and not isinstance(a, str):
        if not (isinstance(b, Sequence) and len(a) == len(b)):
            raise AssertionError(
                f"{path or 'value'}: lengths differ: {len(a)} vs {len(b) if isinstance(b, Sequence) else b!r}"
            )
        for i, (x, y) in enumerate(zip(a, b)):
            _elements(x, y, f"{path}[{i}]", relative, out)
    else:
        x, y = float(a), float(b)
        denom = max(1.0, abs(y)) if relative else 1.0
        d = abs(x - y) / denom if math.isfinite(x - y) else math.inf
        if x == y:  # equal infinities are equal
            d = 0.0
        out.append(Difference(d, path or "value", x, y, abs(y) / denom, 1, relative))


def _tensor_diff(a: Any, b: Any, path: str, relative: bool, out: list[Difference]) -> None:
    import torch

    ta, tb = torch.as_tensor(a).detach().double().cpu(), torch.as_tensor(b).detach().double().cpu()
    if ta.shape != tb.shape:
        raise AssertionError(f"{path or 'value'}: shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
    if ta.numel() == 0:
        out.append(Difference(0.0, path or "value", 0.0, 0.0, 0.0, 0, relative))
        return
    denom = tb.abs().clamp(min=1.0) if relative else torch.ones_like(tb)
    d = torch.where(ta == tb, torch.zeros_like(ta), (ta - tb).abs() / denom)
    d = torch.nan_to_num(d, nan=math.inf)
    flat = int(d.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ta.shape)) if ta.dim() else ()
    where = f"{path}[{', '.join(map(str, idx))}]" if idx else (path or "value")
    scale = float((tb.abs() / denom).max())
    out.append(Difference(float(d.reshape(-1)[flat]), where, float(ta.reshape(-1)[flat]), float(tb.reshape(-1)[flat]),
                          scale, ta.numel(), relative))  # fmt: skip


def max_difference(a: Any, b: Any, *, relative: bool = False) -> Difference:
    """The largest element-wise difference between ``a`` and ``b`` (same
    structure), where it is, and the largest magnitude of ``b`` (the scale of
    the ulp lower bound). Relative differences divide by ``max(1, |b|)``, so
    values below 1 compare absolutely."""
    parts: list[Difference] = []
    _elements(a, b, "", relative, parts)
    if not parts:
        raise AssertionError("nothing to compare: both values are empty")
    worst = max(parts, key=lambda d: d.value)
    return Difference(
        worst.value, worst.where, worst.a, worst.b, max(p.scale for p in parts), sum(p.count for p in parts), relative
    )


def sum_rounding(n_terms: int, dtype: str = "float32") -> float:
    """The typical relative rounding error of a float sum of ``n_terms``
    terms: ``sqrt(n) x u`` (``u`` = half an ulp at 1; rounding errors of a
    sum add like a random walk). A value reduced over a model's whole
    vocabulary (a logsumexp, an entropy) carries this much even when two runs
    sum in the *same* order and so show no difference at all."""
    if dtype not in _EPS:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(_EPS)}")
    return math.sqrt(n_terms) * _EPS[dtype] / 2


def measure_noise_floor(
    what: str,
    reference: Any,
    alternative: Any,
    *,
    relative: bool = False,
    dtype: str = "float32",
    ulps: float = DEFAULT_ULPS,
    lower_bound: float = 0.0,
) -> NoiseFloor:
    """The floor for ``what``: the reference path's result against the same
    path computed in another summation order (``alternative``: another
    micro-batch split, another attention kernel), bounded below by ``ulps``
    units in the last place of ``dtype`` at the reference's magnitude, and by
    ``lower_bound`` (a derived rounding bound the alternative cannot show,
    e.g. ``sum_rounding(vocab)`` for a logprob whose logsumexp both paths
    reduce in the same order)."""
    if dtype not in _EPS:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(_EPS)}")
    measured = max_difference(alternative, reference, relative=relative)
    return NoiseFloor(what, measured, max(ulps * _EPS[dtype] * measured.scale, lower_bound), dtype, ulps)


def assert_within_noise(
    got: Any, reference: Any, floor: NoiseFloor, multiple: float, *, what: str | None = None
) -> Comparison:
    """Assert that ``got`` (the path under test) differs from ``reference`` by
    at most ``multiple`` x ``floor.value``, compared the way the floor was
    (absolute or relative). Returns the comparison (its ``ratio`` is the
    difference in floors); raises ``AssertionError`` saying the difference,
    where, the floor, what it was measured on, and the multiple."""
    if not multiple >= 1.0:
        raise ValueError(f"multiple={multiple}: below 1 the reference itself would fail")
    label = what or floor.what
    diff = max_difference(got, reference, relative=floor.relative)
    limit = multiple * floor.value
    if not diff.value <= limit:  # NaN fails too
        ratio = diff.value / floor.value if floor.value > 0 else math.inf
        raise AssertionError(
            f"{label}: the path under test differs from the reference by {diff}; "
            f"that is {ratio:.3g} x the {floor}; allowed: {multiple:g} x floor = {limit:.3g}"
        )
    return Comparison(label, diff, floor, multiple)
