"""Weight-delivery check: do the inference servers serve the weights the
trainer sent?

After every weight update the trainer picks a deterministic sample of
tensors and element positions keyed by the update's version
(``plan``), reads the sampled elements of what it sent
(``TrainEngine.weight_sample``) and asks every server for a fingerprint of
the same elements of what it loaded (``InferenceEngine.weight_fingerprints``,
one ``ServerProtocol.weight_fingerprint`` route per server). The servers
never see the trainer's numbers; the trainer compares.

Why bit patterns, not float sums: a per-tensor checksum of the sampled
elements' *bit patterns* as integers (their sum and their position-weighted
sum, in wrapping int64) is exact and independent of summation order, device
and kernel, so identical bytes always compare equal and a single flipped bit
in a sampled element never does. A float64 sum would differ in its last bits
between a GPU server and a CPU trainer even on identical weights, and would
need a tolerance that a one-ulp corruption hides under.

Why the trainer casts to the server's dtype before checksumming: a server may
hold the weights in another dtype than the trainer (``model.dtype: bfloat16``
serving, float32 training). Loading converts each value with one
round-to-nearest-even, the same rounding ``Tensor.to`` does, so the trainer's
sampled values cast to the dtype the server reports are bit-identical to
what a correct load holds. (Exact as long as a value is rounded once, or
through a chain that equals one rounding, such as float32 -> bfloat16 ->
bfloat16. A server that quantizes or fuses weights differently cannot be
checked this way; its backend does not implement the route and the check is
skipped with a note.)

Rotation: the tensors are ordered by a hash of their names and dealt into
``K = ceil(n / tensors_per_update)`` chunks (every ``K``-th tensor);
version ``v`` checks chunk ``v mod K``, so every tensor is checked at least
once in any ``K`` consecutive updates. The element positions within a
tensor change with every version.
"""

from __future__ import annotations

import functools
import math
import random
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from areal_kernel.errors import ArealError
from areal_kernel.utils.tensor_sample import sample, sample_named  # re-exported: the check's trainer side

if TYPE_CHECKING:
    import torch

__all__ = [
    "FingerprintSpec",
    "NamedWeights",
    "TensorMismatch",
    "WeightDeliveryError",
    "WeightsMonitor",
    "checksum",
    "checksums",
    "compare",
    "fingerprint",
    "plan",
    "sample",
    "sample_named",
    "rotation_period",
]

WHAT_TO_CHECK = (
    "check the weight transport (weight_update.mode; with disk, that the servers read the directory the trainer "
    "wrote) and the server's log; a backend that quantizes or re-packs weights cannot be compared exactly "
    "(monitor.weights.action: off)"
)


@dataclass(frozen=True)
class FingerprintSpec:
    """What a server fingerprints: for each tensor name, the flat element
    positions to read; ``adapter``: the LoRA adapter whose tensors the names
    are (peft file names), or ``None`` for the base weights."""

    version: int
    positions: dict[str, list[int]]
    adapter: str | None = None
    # Each tensor's shape as the trainer sends it (a server that reads rows
    # needs it to know how many); absent names: unknown.
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        tensors = []
        for n, p in self.positions.items():
            t: dict[str, Any] = {"name": n, "positions": p}
            if n in self.shapes:
                t["shape"] = self.shapes[n]
            tensors.append(t)
        return {"version": self.version, "adapter": self.adapter, "tensors": tensors}

    @classmethod
    def from_json(cls, data: Any) -> "FingerprintSpec":
        """Parse a request body; ``ArealError`` names what is wrong."""
        if not isinstance(data, dict):
            raise ArealError("weight fingerprint: body must be a JSON object")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ArealError(f"weight fingerprint: 'version' must be an integer >= 0, got {version!r}")
        adapter = data.get("adapter")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise ArealError(f"weight fingerprint: 'adapter' must be a non-empty string or null, got {adapter!r}")
        tensors = data.get("tensors")
        if not isinstance(tensors, list):
            raise ArealError("weight fingerprint: 'tensors' must be a list of {name, positions}")
        positions: dict[str, list[int]] = {}
        shapes: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            name = t.get("name") if isinstance(t, dict) else None
            pos = t.get("positions") if isinstance(t, dict) else None
            if not isinstance(name, str) or not name:
                raise ArealError(f"weight fingerprint: tensors[{i}].name must be a non-empty string")
            if not isinstance(pos, list) or not all(
                isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pos
            ):
                raise ArealError(f"weight fingerprint: tensors[{i}].positions must be a list of integers >= 0")
            positions[name] = pos
            shape = t.get("shape")
            if shape is not None:
                if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
                    raise ArealError(f"weight fingerprint: tensors[{i}].shape must be a list of integers >= 0")
                shapes[name] = shape
        return cls(version=version, positions=positions, adapter=adapter, shapes=shapes)


def rotation_period(n_tensors: int, tensors_per_update: int) -> int:
    """``K``: every tensor is checked at least once in any ``K`` consecutive versions."""
    return max(1, math.ceil(n_tensors / max(1, tensors_per_update)))


def _key(*parts: object) -> int:
    # crc32 of the text: stable across processes and Python versions (hash() is salted).
    return zlib.crc32("\x1f".join(str(p) for p in parts).encode())


@functools.lru_cache(maxsize=8)
def _order(tensors: tuple[tuple[str, int], ...], seed: int) -> list[tuple[str, int]]:
    # The same for every version of a run: computed once.
    return sorted((t for t in tensors if t[1] > 0), key=lambda t: (_key(seed, t[0]), t[0]))


def plan(
    tensors: Sequence[tuple[str, int]],
    version: int,
    tensors_per_update: int,
    elements_per_tensor: int,
    seed: int = 0,
    adapter: str | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    within: int | None = None,
) -> FingerprintSpec:
    """The sample of ``version``: ``tensors`` is ``(name, numel)`` of every
    tensor the trainer sends. Deterministic in its arguments; the positions
    are listed explicitly in the spec, so a server needs no random generator
    of its own. ``within``: draw positions among each tensor's first
    ``within`` elements only (``ServerProtocol.fingerprint_prefix``)."""
    order = _order(tuple(tensors), seed)
    per = max(1, tensors_per_update)
    k = rotation_period(len(order), per)
    # Every k-th tensor from offset v mod k: k chunks of near-equal size (at most ``per``).
    chunk = order[version % k :: k]
    positions: dict[str, list[int]] = {}
    for name, numel in chunk:
        rng = random.Random(_key(seed, version, name))
        pool = numel if within is None else min(numel, max(1, within))
        positions[name] = _positions(rng, pool, min(elements_per_tensor, pool))
    kept = {n: [int(x) for x in shapes[n]] for n in positions if shapes is not None and n in shapes}
    return FingerprintSpec(version=version, positions=positions, adapter=adapter, shapes=kept)


def _positions(rng: random.Random, pool: int, k: int) -> list[int]:
    """``k`` distinct positions in ``range(pool)``, sorted. For a large pool
    one ``randbytes`` call per round instead of ``Random.sample``'s k
    (the plan runs over ~50 tensors every update)."""
    if pool <= 4 * k:
        return sorted(rng.sample(range(pool), k))
    chosen: set[int] = set()
    while len(chosen) < k:
        need = k - len(chosen)
        chosen.update(x % pool for x in struct.unpack(f"<{need}Q", rng.randbytes(8 * need)))
    return sorted(chosen)


_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def checksum(values: "torch.Tensor", numel: int | None = None) -> dict[str, Any]:
    """The fingerprint of sampled ``values`` (1-D): ``bits`` and ``wbits``,
    the sum and the position-weighted sum (weights 1..n) of their bit
    patterns as int64 (wrapping; exact, order-free), plus ``sum`` (float64
    sum of the values, for messages only), ``dtype``, ``n`` and the tensor's
    ``numel`` when given."""
    import torch

    v = values.detach().reshape(-1).contiguous()
    if v.dtype == torch.bool:
        v = v.to(torch.uint8)
    bits = v.view(getattr(torch, _INT_OF_SIZE[v.element_size()])).to(torch.int64)
    w = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    out: dict[str, Any] = {
        "dtype": str(values.dtype).removeprefix("torch."),
        "n": int(bits.numel()),
        "bits": int(bits.sum()),
        "wbits": int((bits * w).sum()),
        "sum": float(v.to(torch.float64).sum()) if v.is_floating_point() else float(bits.sum()),
    }
    if numel is not None:
        out["numel"] = int(numel)
    return out


def checksums(values: Sequence["torch.Tensor"], numels: Sequence[int | None] | None = None) -> list[dict[str, Any]]:
    """``checksum`` of each of ``values``, computed in a few batched torch
    operations per dtype instead of a dozen per tensor (the check reads ~50
    tensors per update; per-tensor operations were most of its cost)."""
    import torch

    out: list[dict[str, Any]] = [{} for _ in values]
    groups: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault((v.dtype, v.device), []).append(i)
    for (dtype, device), idx in groups.items():
        parts = [values[i].detach().reshape(-1) for i in idx]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        lens = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=device)
        seg = torch.repeat_interleave(torch.arange(len(parts), device=device), lens)
        starts = torch.cumsum(lens, 0) - lens
        weight = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=device) - starts[seg]
        bits = flat.view(getattr(torch, _INT_OF_SIZE[flat.element_size()])).to(torch.int64)
        s1 = torch.zeros(len(parts), dtype=torch.int64, device=device).index_add_(0, seg, bits).tolist()
        s2 = torch.zeros(len(parts), dtype=torch.int64, device=device).index_add_(0, seg, bits * weight).tolist()
        as_float = flat.to(torch.float64) if flat.is_floating_point() else bits.to(torch.float64)
        fs = torch.zeros(len(parts), dtype=torch.float64, device=device).index_add_(0, seg, as_float).tolist()
        name = str(dtype).removeprefix("torch.")
        for j, i in enumerate(idx):
            out[i] = {"dtype": name, "n": int(lens[j]), "bits": s1[j], "wbits": s2[j], "sum": fs[j]}
            if numels is not None and numels[i] is not None:
                out[i]["numel"] = int(numels[i])  # type: ignore[arg-type]
    return out


def fingerprint(
    table: Mapping[str, "torch.Tensor"], spec: FingerprintSpec, version: int | None = None
) -> dict[str, Any]:
    """What a server answers for ``spec`` over ``table`` (name -> the tensor
    it serves): ``{"version": <the weight version it serves>, "tensors":
    {name: checksum}, "missing": [names it does not have]}``. A position
    beyond a tensor's size is reported as ``{"numel": ...}`` alone (the
    trainer sees the size mismatch). A server that holds a tensor multiplied
    by a factor (vLLM's LoRA ``lora_B``) adds ``"scale": factor`` to that
    tensor's checksum; the trainer multiplies its values, in the server's
    dtype, by it before comparing."""
    tensors: dict[str, Any] = {}
    missing: list[str] = []
    names: list[str] = []
    samples: list[Any] = []
    numels: list[int | None] = []
    for name, pos in spec.positions.items():
        t = table.get(name)
        if t is None:
            missing.append(name)
            continue
        numel = t.numel()
        if any(p >= numel for p in pos):
            tensors[name] = {"numel": int(numel), "dtype": str(t.dtype).removeprefix("torch.")}
            continue
        names.append(name)
        samples.append(sample(t, pos))
        numels.append(numel)
    for name, fp in zip(names, checksums(samples, numels)):
        tensors[name] = fp
    return {"version": version, "tensors": tensors, "missing": missing}


@dataclass(frozen=True)
class TensorMismatch:
    server: str
    tensor: str
    version: int
    detail: str

    def __str__(self) -> str:
        return f"server {self.server}: tensor {self.tensor!r} at version {self.version}: {self.detail}"


def compare(
    sent: Mapping[str, "torch.Tensor"],
    numels: Mapping[str, int],
    spec: FingerprintSpec,
    server: str,
    reply: Any,
) -> tuple[int, list[TensorMismatch]]:
    """Compare one server's ``reply`` with the trainer's sampled values
    ``sent`` (name -> the values at ``spec.positions``, in the trainer's
    dtype); ``numels``: each tensor's size. Returns (tensors compared,
    mismatches).

    A reply with ``"version_only": "<why>"`` carries no checksums: the
    server can report which weight version it serves but cannot read the
    tensors back (SGLang's LoRA adapters). Then only its ``version`` is
    compared (counted as one comparison; a missing or other version is a
    mismatch with tensor ``*`` whose message ends with ``<why>``)."""
    from areal_kernel.weights.broadcast import parse_dtype

    v = spec.version
    if not isinstance(reply, dict) or not isinstance(reply.get("tensors"), dict):
        return 0, [TensorMismatch(server, "*", v, f"unreadable fingerprint reply {str(reply)[:200]}")]
    served = reply.get("version")
    only = reply.get("version_only")
    if isinstance(only, str):
        # The server can tell which version it serves but not read the
        # tensors back (SGLang's LoRA adapters: it reports the directory it
        # loaded, which the protocol mapped to a version): one comparison,
        # the version; the reason stays in the message.
        if served == v and isinstance(served, int):
            return 1, []
        said = (
            f"the server reports serving weight version {served}"
            if isinstance(served, int)
            else f"the server does not report serving version {v}"
        )
        return 1, [TensorMismatch(server, "*", v, f"{said} ({only})")]
    out: list[TensorMismatch] = []
    if isinstance(served, int) and served != v:
        out.append(TensorMismatch(server, "*", v, f"the server reports serving weight version {served}"))
    got = reply["tensors"]
    missing = set(reply.get("missing") or ())
    unreadable = set(reply.get("unreadable") or ())
    checked = 0
    todo: list[tuple[str, Any, Any]] = []  # (name, the server's reply, the trainer's values in the server's dtype)
    for name in spec.positions:
        if name in unreadable:
            continue  # held in a form the server cannot read back (see fingerprint's "unreadable")
        checked += 1
        if name in missing or name not in got:
            out.append(TensorMismatch(server, name, v, "the server has no tensor of this name"))
            continue
        r = got[name]
        if r.get("numel") != numels[name]:
            out.append(TensorMismatch(server, name, v, f"{r.get('numel')} elements on the server, {numels[name]} sent"))
            continue
        try:
            dtype = parse_dtype(str(r.get("dtype")))
        except ArealError:
            out.append(TensorMismatch(server, name, v, f"the server reports an unknown dtype {r.get('dtype')!r}"))
            continue
        values = sent[name]
        mine = values.to(dtype) if values.dtype != dtype else values
        scale = r.get("scale")
        if scale is not None:
            # The server holds the values multiplied by ``scale`` in its dtype
            # (vLLM folds a LoRA adapter's scaling into lora_B): one rounded
            # multiplication, the same here as there, so bits still compare.
            if not isinstance(scale, (int, float)) or isinstance(scale, bool):
                out.append(TensorMismatch(server, name, v, f"the server reports a non-numeric scale {scale!r}"))
                continue
            mine = mine * float(scale)
        todo.append((name, r, mine))
    mine_all = checksums([t[2] for t in todo])
    for (name, r, _), mine in zip(todo, mine_all):
        values = sent[name]
        if (r.get("n"), r.get("bits"), r.get("wbits")) != (mine["n"], mine["bits"], mine["wbits"]):
            sent_dtype = str(values.dtype).removeprefix("torch.")
            cast = "" if sent_dtype == mine["dtype"] else f" after casting the trainer's {sent_dtype} to it"
            out.append(
                TensorMismatch(
                    server, name, v,
                    f"the checksum of {mine['n']} sampled elements differs from what the trainer sent (the "
                    f"server's {r.get('dtype')} values sum to {r.get('sum')!r}, the trainer's{cast} to {mine['sum']!r})",
                )
            )  # fmt: skip
    return checked, out


class NamedWeights:
    """The trainer side of the check over a fixed list of named tensors: what
    ``WeightsMonitor.check`` reads of a train engine (its weights, no adapter).
    For tests and tools that check servers against weights they hold (an HF
    directory: ``from_dir``) rather than against a train engine."""

    def __init__(self, named: Sequence[tuple[str, Any]]) -> None:
        self.named = list(named)

    @classmethod
    def from_dir(cls, model_dir: str) -> "NamedWeights":
        """The tensors of the ``*.safetensors`` files in ``model_dir``, by name."""
        import glob
        import os

        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise ArealError(f"{model_dir}: no .safetensors file to read weights from")
        return cls([kv for f in files for kv in sorted(load_file(f).items())])

    def adapter_spec(self) -> None:
        return None

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        return self.named

    def weight_sample(self, positions: Mapping[str, Sequence[int]]) -> dict[str, Any]:
        return sample_named(self.named, positions)


class WeightDeliveryError(ArealError):
    """``monitor.weights.action: error`` and a server serves other weights than the trainer sent."""


@dataclass
class WeightsMonitor:
    """Runs the check after a weight update (``check``) and turns a mismatch
    into a warning (``warn``) or, with ``error``, a pending
    ``WeightDeliveryError`` that ``raise_if_alarmed`` raises once the trainer
    logged the step's metrics."""

    action: str = "error"
    tensors_per_update: int = 40
    elements_per_tensor: int = 64
    seed: int = 0
    warn: Callable[[str], None] = field(default=print)
    pending: str | None = None
    skipped: str | None = None  # why the check cannot run (said once)
    # Said once: a server answered its version only (see compare's "version_only").
    version_only_noted: bool = False
    mismatches: list[TensorMismatch] = field(default_factory=list)
    _numels: dict[str, int] | None = None
    _shapes: dict[str, list[int]] = field(default_factory=dict)
    # Tensors a server reported it cannot read back: left out of later plans.
    unreadable: set[str] = field(default_factory=set)

    def _skip(self, why: str) -> dict[str, float]:
        if self.skipped is None:
            self.skipped = why
            self.warn(f"note: weight-delivery check (monitor.weights) is skipped: {why}")
        return {}

    def check(self, version: int, train_engine: Any, inference_engine: Any) -> dict[str, float]:
        """Check update ``version``; returns the metrics (without the
        ``monitor/`` prefix): ``weights_checked`` (tensor x server pairs
        compared), ``weights_mismatch``, ``weights_servers`` (servers that
        answered) and ``weights_check_s``."""
        if self.action == "off" or self.skipped is not None:
            return {}
        t0 = time.monotonic()
        adapter = train_engine.adapter_spec()
        if self._numels is None:
            named = train_engine.named_weights_for_transfer()
            self._numels = {n: int(t.numel()) for n, t in named}
            self._shapes = {n: list(t.shape) for n, t in named}
        within = getattr(getattr(inference_engine, "protocol", None), "fingerprint_prefix", None)
        spec = plan(
            [t for t in self._numels.items() if t[0] not in self.unreadable], version, self.tensors_per_update, self.elements_per_tensor, self.seed,
            adapter=adapter.name if adapter is not None else None, shapes=self._shapes, within=within,
        )  # fmt: skip
        try:
            sent = train_engine.weight_sample(spec.positions)
        except NotImplementedError as e:
            return self._skip(str(e))
        try:
            replies, errors = inference_engine.weight_fingerprints(spec.to_json())
        except NotImplementedError as e:
            return self._skip(str(e))
        checked = 0
        found: list[TensorMismatch] = []
        for server, reply in replies.items():
            self._note_unreadable(server, reply)
            self._note_version_only(server, reply, spec)
            n, bad = compare(sent, self._numels, spec, server, reply)
            checked += n
            found.extend(bad)
        for server, err in errors.items():
            # A server that could not answer (being restarted, overloaded) is
            # not a delivery fault; its resync replays the update.
            self.warn(f"warning: weight-delivery check at version {version}: server {server} did not answer: {err}")
        self.mismatches.extend(found)
        if found:
            tensors = sorted({m.tensor for m in found})
            msg = (
                f"weight delivery check failed at version {version}: {found[0]}"
                + (f" (and {len(found) - 1} more: tensors {tensors[:6]})" if len(found) > 1 else "")
                + f"; {WHAT_TO_CHECK}"
            )
            if self.action == "error":
                self.pending = self.pending or msg
            else:
                self.warn(f"warning: {msg}")
        return {
            "weights_checked": float(checked),
            "weights_mismatch": float(len(found)),
            "weights_servers": float(len(replies)),
            "weights_check_s": time.monotonic() - t0,
        }

    def _note_version_only(self, server: str, reply: Any, spec: FingerprintSpec) -> None:
        why = reply.get("version_only") if isinstance(reply, dict) else None
        if not isinstance(why, str) or self.version_only_noted:
            return
        self.version_only_noted = True
        what = f"adapter {spec.adapter!r}" if spec.adapter is not None else "the weights"
        self.warn(
            f"note: weight-delivery check: server {server} answers the version of {what} only, not its bytes ({why})"
        )

    def _note_unreadable(self, server: str, reply: Any) -> None:
        names = reply.get("unreadable") if isinstance(reply, dict) else None
        new = sorted(set(names or ()) - self.unreadable) if isinstance(names, list) else []
        if not new:
            return
        self.unreadable.update(new)
        left = sum(1 for n in self._numels or {} if n not in self.unreadable)
        self.warn(
            f"note: weight-delivery check: server {server} cannot read back {len(new)} tensor(s) it holds in "
            f"another form (e.g. {new[0]!r}); later checks sample the {left} tensor(s) left"
        )
        if left == 0:
            self._skip("the servers can read back none of the tensors the trainer sends")

    def raise_if_alarmed(self) -> None:
        """Raise ``WeightDeliveryError`` when ``action: error`` and a check failed."""
        if self.pending is not None:
            msg, self.pending = self.pending, None
            raise WeightDeliveryError(msg)
