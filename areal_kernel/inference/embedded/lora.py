"""LoRA adapters served by the embedded server beside unchanged base weights.

Why not merge the adapter into the weights: several adapters are served at
once (requests name theirs, so two runs can train against one server), and
the train engine computes an adapted layer unmerged, as peft does:
``base(x) + (x @ A.T) @ B.T * scale``. Computing the same expression here
keeps the server's logprobs equal to the engine's recompute up to float
rounding of the same operations; a merged ``W + scale * B @ A`` would round
differently and could not serve a second adapter.

Mechanism: a forward hook on each adapted ``nn.Linear`` adds the update of
the adapter each batch row uses (``rows``, set by the engine before every
forward). Hooks leave parameter names and the base tensors untouched, so
full-weight updates keep working, and a model with no adapter loaded runs
without hooks.

A batch whose rows use several adapters (a multi-policy run's server
batches every policy's requests together) computes all of a layer's
adapters at once: their ``A`` stacked along the rank, ``x @ A_all.T``
for every row, each row's columns of other adapters zeroed (and its own
scaled) by a per-row mask, then ``@ B_all.T``. That is four operations per
layer whatever the number of adapters, where adapter by adapter it was
seven per adapter plus a copy; the extra multiplications (every row through
every adapter's ``A``) are small beside the base layer's at LoRA ranks. Why:
on a GPU a small model's decode step is bound by kernel launches, and on one
H200 a two-adapter batch was served no faster than two one-adapter batches
(docs/multi-policy.md). A batch of one adapter keeps peft's expression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from areal_kernel.errors import ArealError

_PREFIX = "base_model.model."
_SUPPORTED_KEYS = (".lora_A.weight", ".lora_B.weight")


@dataclass
class _Update:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class _Stack:
    """Every loaded adapter of one layer, stacked along the rank (for mixed batches)."""

    names: tuple[str, ...]  # the adapters that adapt this layer, in stacking order
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [out, sum of ranks]
    spans: tuple[tuple[int, int, float], ...]  # per name: its columns [start, end) and its scale


def adapter_scale(config: dict[str, Any]) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), as peft scales."""
    r = config.get("r")
    alpha = config.get("lora_alpha", r)
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ArealError(f"adapter config: 'r' must be an integer >= 1 and 'lora_alpha' a number, got {r!r}, {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ArealError(f"adapter config: per-module {key} is not supported by the embedded server")
    if config.get("use_dora"):
        raise ArealError("adapter config: DoRA adapters (use_dora) are not supported by the embedded server")
    return float(alpha) / (r**0.5 if config.get("use_rslora") else r)


class AdapterSet:
    """The adapters one model serves; used only on the engine thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, dict[str, _Update]] = {}
        self.versions: dict[str, int] = {}
        self._hooks: dict[str, Any] = {}
        self._stacks: dict[str, _Stack] = {}  # per adapted layer (_restack)
        self.rows = []

    @property
    def rows(self) -> list[str | None]:
        """The adapter name (or None: base) of each row of the next forward;
        the engine sets it before every forward."""
        return self._rows

    @rows.setter
    def rows(self, names: list[str | None]) -> None:
        self._rows = list(names)
        distinct = set(self._rows)
        self._only: str | None = next(iter(distinct)) if len(distinct) == 1 else None
        self._mixed = len(distinct) > 1
        # Per stacking (layers adapted by the same adapters share one): the
        # rows' mask on a device, made once per forward.
        self._masks: dict[tuple[Any, ...], torch.Tensor] = {}

    def _row_mask(self, stack: _Stack, like: torch.Tensor) -> torch.Tensor:
        """``[rows, 1, sum of ranks]`` (one 1 per dim of ``like`` between
        rows and features): a row's own adapter's columns hold its
        scale, every other column 0 (a base row, or a row whose adapter does
        not adapt this layer: all 0). Made once per forward and stacking and
        shared by the layers, since building it in each layer's hook costs a
        copy from host memory per layer, which on a GPU waits for the queued
        kernels (420 waits per decode step on SmolLM2's 30 x 7 layers)."""
        key = (stack.names, stack.spans, like.device, like.dtype, like.dim())
        mask = self._masks.get(key)
        if mask is None:
            where = dict(zip(stack.names, stack.spans))
            width = stack.a.shape[0]
            data = []
            for name in self._rows:
                row = [0.0] * width
                if name in where:
                    start, end, scale = where[name]
                    row[start:end] = [scale] * (end - start)
                data.append(row)
            # Built in Python: one tensor operation (the copy), however many rows.
            mask = torch.tensor(data, dtype=like.dtype, device=like.device)
            # One row per batch row, broadcast over the positions between.
            mask = self._masks[key] = mask.view(len(data), *([1] * (like.dim() - 2)), width)
        return mask

    def _restack(self) -> None:
        """Stack every adapted layer's adapters for mixed batches (one
        adapter's rows beside the base's are one too). A layer with one
        adapter uses its tensors as they are; with several, the stacked
        copies hold the adapters a second time (adapters are small beside
        the base). Done when an adapter changes, not at the next mixed
        forward: tensors that outlive a forward, made in the middle of its
        activations, kept the freed activations' memory from going back
        (about 0.8 GB more resident in a SmolLM2 server, measured)."""
        self._stacks = {}
        for module in {m for ups in self.adapters.values() for m in ups}:
            names = tuple(n for n, ups in self.adapters.items() if module in ups)
            ups = [self.adapters[n][module] for n in names]
            spans, start = [], 0
            for up in ups:
                spans.append((start, start + up.a.shape[0], up.scale))
                start += up.a.shape[0]
            if len(ups) == 1:
                a, b = ups[0].a, ups[0].b
            else:
                a, b = torch.cat([up.a for up in ups]), torch.cat([up.b for up in ups], dim=1)
            self._stacks[module] = _Stack(names, a, b, tuple(spans))

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def check(self, config: dict[str, Any], meta: Iterable[dict[str, Any]]) -> None:
        """Validate an adapter (its config and tensor names/shapes) before anything changes."""
        adapter_scale(config)
        r = int(config["r"])
        for m in meta:
            name, shape = m["name"], list(m.get("shape", []))
            module, kind = self._split(name)
            lin = self._linear(module, name)
            want = [r, lin.in_features] if kind == "A" else [lin.out_features, r]
            if shape != want:
                raise ArealError(f"adapter tensor {name!r}: shape {shape} does not match {want} (r={r})")

    def load(self, name: str, config: dict[str, Any], named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Serve ``named`` (peft file names -> tensors) under ``name``, replacing
        what was served under it. Call ``check`` first."""
        scale = adapter_scale(config)
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tname, t in named:
            module, kind = self._split(tname)
            lin = self._linear(module, tname)
            parts.setdefault(module, {})[kind] = t.to(device=lin.weight.device, dtype=lin.weight.dtype).clone()
        updates = {}
        for module, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise ArealError(f"adapter {name!r}: module {module!r} has lora_{next(iter(ab))} without its pair")
            updates[module] = _Update(ab["A"], ab["B"], scale)
        if not updates:
            raise ArealError(f"adapter {name!r} holds no LoRA tensors")
        self.adapters[name] = updates
        self.versions[name] = version
        self._restack()
        self._sync_hooks()

    def tensor_table(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s tensors under their peft file names, as served
        (in the base layer's dtype): what the weight-delivery check reads."""
        out: dict[str, torch.Tensor] = {}
        for module, up in self.adapters[name].items():
            out[f"{_PREFIX}{module}.lora_A.weight"] = up.a
            out[f"{_PREFIX}{module}.lora_B.weight"] = up.b
        return out

    def unload(self, name: str) -> bool:
        found = self.adapters.pop(name, None) is not None
        self.versions.pop(name, None)
        self._restack()
        self._sync_hooks()
        return found

    # -- internals --------------------------------------------------------------
    def _split(self, name: str) -> tuple[str, str]:
        if not name.startswith(_PREFIX) or not name.endswith(_SUPPORTED_KEYS):
            raise ArealError(
                f"adapter tensor {name!r}: expected peft names 'base_model.model.<module>.lora_A.weight' / "
                "'.lora_B.weight' (other adapter kinds are not supported)"
            )
        body = name[len(_PREFIX) :]
        return body.rsplit(".lora_", 1)[0], body[-len("A.weight")]

    def _linear(self, module: str, tname: str) -> torch.nn.Linear:
        try:
            lin = self.model.get_submodule(module)
        except AttributeError:
            raise ArealError(f"adapter tensor {tname!r}: the model has no module {module!r}") from None
        if not isinstance(lin, torch.nn.Linear):
            raise ArealError(f"adapter tensor {tname!r}: {module!r} is not a linear layer")
        return lin

    def _sync_hooks(self) -> None:
        wanted = {m for ups in self.adapters.values() for m in ups}
        for m in list(self._hooks):
            if m not in wanted:
                self._hooks.pop(m).remove()
        for m in wanted - set(self._hooks):
            self._hooks[m] = self.model.get_submodule(m).register_forward_hook(self._hook(m))

    def _hook(self, module: str) -> Any:
        def add_update(_mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            if not self._mixed:
                up = self._update(self._only, module)
                if up is None:
                    return out
                # The expression peft's unmerged layer computes.
                return out + torch.nn.functional.linear(torch.nn.functional.linear(x, up.a), up.b) * up.scale
            stack = self._stacks.get(module)
            if stack is None:  # no adapter adapts this layer
                return out
            # x is [rows, positions, in]; the mask broadcasts over positions.
            xa = torch.nn.functional.linear(x, stack.a) * self._row_mask(stack, x)
            return out + torch.nn.functional.linear(xa, stack.b)

        return add_update

    def _update(self, name: str | None, module: str) -> _Update | None:
        if name is None:
            return None
        return self.adapters[name].get(module)
