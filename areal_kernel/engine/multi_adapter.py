"""Several LoRA adapters on one frozen base in the torch engine: one view per policy.

With ``adapters: [{name: a, ...}, {name: b, ...}]`` in its settings,
``TorchTrainEngine.initialize`` wraps the base model once with every adapter
(``areal_kernel.engine.lora.apply_adapters``) and builds one
``AdapterPolicy`` per entry; ``engine.policy(name)`` returns it. The view
implements the ``TrainEngine`` contract for that adapter alone, so code
written for one policy (the RL step, the weight transports, the checkpoint
code) runs unchanged against a view.

Call order: ``engine = TorchTrainEngine(settings)`` -> ``engine.initialize``
(the views exist from here) -> per policy, any of ``view.compute_logprobs`` /
``view.train_batch`` / ``view.save_hf`` / ``view.send_weights`` /
``view.save_state`` ... in any interleaving -> ``engine.save_state`` /
``engine.load_state`` for every policy at once -> ``engine.destroy``. Calls
on the engine that concern one policy (``train_batch``, ``compute_logprobs``,
exports, weight transfer) raise ``ConfigError`` pointing at ``policy(name)``.

What a view owns: its adapter's parameters (peft adapter
``peft_adapter_name(i)``), its AdamW optimizer over them, its lr-schedule
step (``step``; the schedule's settings and ``total_train_steps`` are the
engine's), its weight version (``get_version``), its export mode
(``lora.export``) and its served name (``lora.name``). Shared, owned by the
engine: the frozen base, the micro-batch runner, the RNG (dropout) and the
broadcast weight group.

Switching adapters is ``peft``'s ``set_adapter`` before a call (the active
adapter trains, the others are frozen and do not take part in the forward):
each call runs the base once for its own adapter's batch. Training ``a`` never
touches ``b``'s parameters or optimizer, so ``b`` scores exactly as before.
``engine.train_policies`` (``areal_kernel.engine.together``) steps several
policies at once, their micro-batches sharing the base's forwards.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

from areal_kernel.api.engine import AdapterSpec, TrainEngine, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import MicroBatchRunner, check_batch
from areal_kernel.engine.optimizer_state import load_optimizer_state, save_optimizer_state
from areal_kernel.engine.state import (
    load_rng_state,
    make_optimizer,
    python_random_state,
    read_engine_state,
    save_rng_state,
    set_lr,
    set_python_random_state,
    write_engine_state,
)
from areal_kernel.errors import ArealError, DataError
from areal_kernel.utils.fs import atomic_dir

if TYPE_CHECKING:
    from areal_kernel.engine.config import LoraConfig
    from areal_kernel.engine.torch_engine import TorchTrainEngine

# engine_state.json's ``engine`` of a view's checkpoint and of the engine's
# checkpoint of every view: neither loads as the other, nor as a one-adapter one.
POLICY_STATE = "torch-adapter"
POLICIES_STATE = "torch-adapters"
ADAPTERS_DIR = "adapters"


class PolicyView(TrainEngine):
    """What every policy's view of a multi-adapter engine shares, whichever
    engine it views (``AdapterPolicy`` here; areal-fsdp's ``FSDPAdapterPolicy``):
    it belongs to ``engine`` and is never initialized or destroyed on its
    own; it counts its own optimizer steps (``step``, settable); its temperature and
    learning-rate schedule come from ``settings`` (the engine's settings,
    with this policy's adapter); and it joins the engine's one broadcast
    group. A subclass sets ``engine``, ``settings``, ``name`` and ``step``."""

    engine: Any
    settings: Any
    name: str
    _step: int

    def initialize(self, model_path: str, total_train_steps: int) -> None:
        raise ArealError(f"policy {self.name!r} is a view of its engine: initialize the engine, not the view")

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)

    @property
    def temperature(self) -> float:
        return float(self.settings.temperature)

    def current_lr(self) -> float:
        return scheduled_lr(self.settings, self._step, self.engine.total_train_steps)

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int = 0,
        group_name: str = "areal_weights",
        backend: str | None = None,
        timeout_s: float = 300,
    ) -> Any:
        """The engine's broadcast group (one per engine, shared by its policies)."""
        return self.engine.init_weight_group(
            master_addr, master_port, world_size, rank, group_name, backend=backend, timeout_s=timeout_s
        )

    def destroy(self) -> None:
        """Nothing: the engine owns the model (``engine.destroy``)."""


class AdapterPolicy(PolicyView):
    """One adapter of a ``TorchTrainEngine`` with ``adapters``, as a
    ``TrainEngine`` (see the module docstring). Built by the engine; never
    initialized or destroyed on its own."""

    def __init__(self, engine: "TorchTrainEngine", lora: "LoraConfig", peft_name: str) -> None:
        from areal_kernel.engine.lora import adapter_params

        self.engine = engine
        self.settings = engine.config
        self.lora = lora
        self.name = lora.name
        self.peft_name = peft_name
        self._params = adapter_params(engine.model, peft_name)  # (peft file name, live parameter)
        self.optimizer = make_optimizer([p for _, p in self._params], engine.config)
        self._step = 0
        self._version = 0
        self._set_lr()

    # ------------------------------------------------------------ bookkeeping
    def _set_lr(self) -> float:
        return set_lr(self.optimizer, self.current_lr())

    def set_lr(self) -> float:
        """Set this policy's scheduled lr for its next step; returns it
        (``areal_kernel.engine.together`` steps the optimizer itself)."""
        return self._set_lr()

    def adapter_parameters(self) -> list[tuple[str, Any]]:
        """``(peft file name, live parameter)`` of this policy's adapter."""
        return list(self._params)

    def _runner(self) -> MicroBatchRunner:
        return self.engine.run_with_adapter(self.peft_name)

    # ---------------------------------------------------------------- scoring
    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the base plus this adapter (as the engine's)."""
        runner = self._runner()
        check_batch(batch)
        return runner.score(batch, only_loss_tokens)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        runner = self._runner()
        check_batch(batch)
        return runner.score(batch)

    # --------------------------------------------------------------- training
    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One step of this adapter's optimizer over ``batch``; statistics as
        ``TorchTrainEngine.train_batch``."""
        runner = self._runner()
        check_batch(batch, extra)
        t0 = time.perf_counter()
        # Every gradient of the model, not only this optimizer's: another
        # adapter's last step leaves its gradients, which the clip would count.
        self.engine.model.zero_grad(set_to_none=True)
        lr = self._set_lr()
        out = self.engine.optimizer_step(runner, self.optimizer, lr, batch, loss_fn, extra)
        self._step += 1
        out["step_time_s"] = time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------- weights
    def adapter_spec(self) -> AdapterSpec:
        from areal_kernel.engine.lora import adapter_config

        return AdapterSpec(self.name, adapter_config(self.engine.model, self.engine.model_path, self.peft_name))

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """This adapter's tensors under peft's file names (detached views of the live ones)."""
        return [(n, p.detach()) for n, p in self._params]

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        from areal_kernel.weights.broadcast import tensor_meta

        return tensor_meta(self.named_weights_for_transfer())

    def write_adapter(self, path: str) -> None:
        """This adapter alone as a peft directory at ``path`` (a disk weight update)."""
        from areal_kernel.engine.lora import write_adapter_dir

        write_adapter_dir(path, self.named_weights_for_transfer(), self.adapter_spec().config)

    def save_hf(self, path: str) -> None:
        """A peft adapter directory of this adapter, or the base with it merged
        in (``lora.export``), with the source model's tokenizer files."""
        from areal_kernel.engine import lora as L

        model, source = self.engine.model, self.engine.model_path
        if self.lora.export == "merged":
            L.save_merged_hf_dir(path, model, source, self.peft_name)
        else:
            L.save_adapter_hf_dir(path, self.named_weights_for_transfer(), self.adapter_spec().config, source)

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """Send this adapter only: a peft directory at ``meta.path`` (disk) or
        its tensors over the engine's broadcast group."""
        self.engine.send_by_kind(meta, self.write_adapter, self.named_weights_for_transfer)

    # ------------------------------------------------------------- checkpoint
    def save_state(self, path: str) -> None:
        """This adapter's weights, optimizer moments, schedule step and version,
        atomically. Not the RNG, which every policy of the engine shares: the
        engine's ``save_state`` holds it beside every policy's state."""
        with atomic_dir(path) as tmp:
            self.write_state(tmp)

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote (for this policy's adapter)."""
        self.read_state(path)

    def write_state(self, directory: str) -> None:
        """``save_state`` into the existing ``directory``."""
        from safetensors.torch import save_file

        save_file({n: p.detach().contiguous() for n, p in self._params}, os.path.join(directory, "adapter.safetensors"))
        opt = save_optimizer_state(self.optimizer, os.path.join(directory, "optimizer.safetensors"))
        write_engine_state(directory, POLICY_STATE, {
            "name": self.name,
            "step": self._step,
            "version": self.get_version(),
            "total_train_steps": self.engine.total_train_steps,
            "param_names": [n for n, _ in self._params],
            "optimizer_param_groups": opt["param_groups"],
            "optimizer_scalars": opt["scalars"],
            "lora": self.lora.model_dump(),
        })  # fmt: skip

    def read_state(self, path: str) -> None:
        import torch
        from safetensors.torch import load_file

        meta = read_engine_state(path, POLICY_STATE)
        names = [n for n, _ in self._params]
        if meta["param_names"] != names:
            raise DataError(
                f"{path!r} was saved from another adapter shape than policy {self.name!r} "
                "(rank or target_modules differ: parameter names differ)"
            )
        dev = str(self.engine.device)
        weights = load_file(os.path.join(path, "adapter.safetensors"), device=dev)
        with torch.no_grad():
            for n, p in self._params:
                p.copy_(weights[n])
        load_optimizer_state(
            self.optimizer,
            os.path.join(path, "optimizer.safetensors"),
            {"param_groups": meta["optimizer_param_groups"], "scalars": meta["optimizer_scalars"]},
            dev,
        )
        self._step = int(meta["step"])
        self.set_version(int(meta["version"]))
        self._set_lr()


def save_policies_state(engine: "TorchTrainEngine", path: str) -> None:
    """``engine.save_state`` with ``adapters``: every policy's state under
    ``adapters/<name>/``, the shared RNG states and the engine's version."""
    engine.require_model()
    with atomic_dir(path) as tmp:
        for name, view in engine._policies.items():
            sub = os.path.join(tmp, ADAPTERS_DIR, name)
            os.makedirs(sub)
            view.write_state(sub)
        save_rng_state(os.path.join(tmp, "rng.safetensors"))
        write_engine_state(tmp, POLICIES_STATE, {
            "policies": list(engine._policies),
            "version": engine.get_version(),
            "total_train_steps": engine.total_train_steps,
            "base_param_names": [n for n, _ in engine.model.named_parameters() if ".lora_" not in n],
            "python_random": python_random_state(),
            "config": engine.config.model_dump(),
        })  # fmt: skip


def load_policies_state(engine: "TorchTrainEngine", path: str) -> None:
    """Restore what ``save_policies_state`` wrote; ``DataError`` when the
    checkpoint holds other policies than the engine's."""
    engine.require_model()
    meta = read_engine_state(path, POLICIES_STATE)
    saved, have = list(meta["policies"]), list(engine._policies)
    if sorted(saved) != sorted(have):
        raise DataError(f"{path!r} holds the policies {saved}, this engine trains {have}")
    base = [n for n, _ in engine.model.named_parameters() if ".lora_" not in n]
    if meta["base_param_names"] != base:
        raise DataError(f"{path!r} was saved from a different model architecture (parameter names differ)")
    for name, view in engine._policies.items():
        view.read_state(os.path.join(path, ADAPTERS_DIR, name))
    load_rng_state(os.path.join(path, "rng.safetensors"))
    set_python_random_state(meta["python_random"])
    engine.set_version(int(meta["version"]))
