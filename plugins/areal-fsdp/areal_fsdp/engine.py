"""``FSDPTrainEngine``: the controller-side face of N FSDP rank processes.

It implements the kernel's ``TrainEngine`` API in the controller process
(which imports torch but never holds the model), and drives the ranks
(``areal_fsdp.rank``) through the kernel's ranked-engine base
(``areal_kernel.engine.ranked.RankedTrainEngine``, on the rank plumbing of
``areal_kernel.engine.ranks``): every call is sent to every rank, each with
its share of the batch, and the answers are merged. What is FSDP's own here:
the d x t layout (``areal_fsdp.layout``: FSDP2 over d, DTensor tensor
parallelism over t), how parts reach the ranks, and the LoRA adapter.

Why this shape: the kernel's trainer is a single controller that calls
``train_batch`` / ``compute_logprobs`` / ``send_weights`` on one object; the
ranks are real processes with the torch.distributed environment, started by
the scheduler (``LocalScheduler.start_train_ranks``), so the same engine
works under any scheduler that can start ranks.

Data parallelism: a batch is split into N parts balanced by tokens (whole
GRPO groups stay together when prompt sharing is on and there are enough
groups). Losses follow the kernel's loss contract: each micro-batch returns
its share of the *batch* loss (normalised by ``batch_loss_tokens`` /
``batch_n_seqs`` of the whole batch), the ranks sum their gradients (FSDP's
averaging is turned off), so a step equals the single-process step however
the batch is split across ranks and micro-batches.

Tensor parallelism (``fsdp:t2``, ``fsdp:d2t2``): the batch is split into
``d`` parts; the ``t`` ranks of one replica receive the same part and run
the same micro-batches in lockstep (their collectives pair up), and tensor
rank 0 of each replica reports the part's answer (the others computed the
same numbers).

Pipeline parallelism (``fsdp:p2``; ``areal_fsdp.pipeline``): every rank
receives the whole batch and runs its stages of the
``torch.distributed.pipelining`` schedule (``actor.fsdp.pipeline_schedule``);
the rank holding the last stage answers (the loss, stats, logprobs and
entropies are computed there), the others answer None.

Expert parallelism (``fsdp:d2e2``; ``areal_fsdp.expert_parallel``): data
parallelism as above, with the experts of every MoE layer split over the
data ranks (tokens travel to their experts' rank and back by all-to-all).
The ranks report raw router sums with their answers; ``train_batch`` turns
the summed values into the load-balancing loss and per-expert load metrics
(``moe_*``; a metric only, not added to the loss, as in the torch engine).

Context parallelism (``fsdp:c2``, ``fsdp:d2c2``; ``areal_fsdp.context_parallel``):
the batch is split into ``d`` parts; the ``c`` ranks of one replica receive
the same part, each runs its chunk of every micro-batch's sequence, and all
of them end with the whole row's logprobs and loss; context rank 0 of each
replica answers for the part.

Failure handling: a rank that raises reports its traceback; if the other
ranks also answer, the engine stays usable and the error is re-raised
(same type for kernel errors). If a rank dies or the others hang in a
collective, every rank is stopped and the engine refuses further calls.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Callable

from areal_kernel.api.engine import AdapterSpec
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.allocation import Allocation
from areal_kernel.engine.ranked import RankedTrainEngine
from areal_kernel.engine.ranks import RankError
from areal_kernel.logging import get_logger
from areal_kernel.utils.fs import atomic_dir

from areal_fsdp.config import FSDPEngineConfig
from areal_fsdp.layout import Layout, check_layout_settings, layout_of
from areal_fsdp.multi_adapter import FSDPPolicies

log = get_logger(__name__)


__all__ = ["FSDPTrainEngine", "RankError"]


class FSDPTrainEngine(FSDPPolicies, RankedTrainEngine):
    """FSDP2 train engine over ``world_size`` rank processes.

    The kernel builds it with ``FSDPTrainEngine.from_context(context)``: the
    allocation (``actor.backend: fsdp:d2``, ``fsdp:t2``, ``fsdp:d2t2``,
    ``fsdp:p2``, ``fsdp:d2e2``, ``fsdp:d2c2``) gives the layout, the run's scheduler starts
    the ranks, their logs go to
    ``<run_dir>/fsdp-ranks`` (``fsdp-ranks-<role>`` for a reference model).
    Built directly (tests, scripts): ``allocation`` is ``"fsdp:d2"`` or an
    ``Allocation``, ``world_size`` a shortcut for ``fsdp:d<world_size>``
    (default one rank), and a ``local`` scheduler of its own starts the ranks.
    """

    engine_name = "fsdp"
    rank_module = "areal_fsdp.rank"
    save_state_command = "dcp_save"  # torch.distributed.checkpoint: any rank count can load it (DCP reshards)
    load_state_command = "dcp_load"
    rank_weight_sample = True  # the weight-delivery check samples in the ranks

    config: FSDPEngineConfig

    @classmethod
    def mesh_coords(cls, allocation: Any) -> list[dict[str, int]]:
        """Each rank's coordinates in the device mesh (``{"d": 0, "t": 1}``;
        ``d``/``p`` with pipeline, ``d``/``e`` with experts): what `areal plan`
        shows per actor placement. Raises ``ConfigError`` for a layout the
        engine refuses."""
        from areal_fsdp.layout import layout_of

        layout = layout_of(allocation)
        return [layout.rank_coords(r) for r in range(layout.world_size)]

    def __init__(
        self,
        config: FSDPEngineConfig | dict[str, Any] | None = None,
        allocation: Allocation | str | None = None,
        *,
        world_size: int | None = None,
        log_dir: str | None = None,
        scheduler: Any = None,
        run_config: Any = None,
    ) -> None:
        settings = FSDPEngineConfig.parse(config)
        if allocation is None and world_size is not None:
            allocation = f"fsdp:d{int(world_size)}"
        self.layout: Layout = layout_of(allocation)
        check_layout_settings(self.layout, settings)
        self.allocation = Allocation(
            backend="fsdp", d=self.layout.dp, t=self.layout.tp, p=self.layout.pp, e=self.layout.ep, c=self.layout.cp
        )
        super().__init__(
            settings,
            self.layout.world_size,
            log_dir=log_dir,
            scheduler=scheduler,
            run_config=run_config,
        )
        self._adapter_config: dict[str, Any] | None = None
        # Expert parallelism: (num_experts, top_k) of the model, for the router metrics.
        self._moe_shape: tuple[int, int] | None = None

    def initialize(self, model_path: str, total_train_steps: int) -> None:
        """As the base class; with an ``e`` or ``c`` dim the model's
        config.json is checked first (a mixture-of-experts model whose experts
        divide by ``e``; an attention the context ranks compute), so a wrong
        model is refused before any rank starts."""
        cfg_file = os.path.join(model_path, "config.json")
        # Else the base class names the missing file.
        if (self.layout.ep > 1 or self.layout.cp > 1) and os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                hf = json.load(f)
            fields = SimpleNamespace(**(hf.get("text_config") or hf))
            if self.layout.ep > 1:
                from areal_fsdp.expert_parallel import check_ep_model

                check_ep_model(fields, self.layout.ep, str(self.allocation))
            if self.layout.cp > 1:
                from areal_fsdp.context_parallel import check_cp_model

                check_cp_model(fields, self.layout.cp, str(self.layout))
        super().initialize(model_path, total_train_steps)

    # ------------------------------------------------------- base-class hooks
    @property
    def data_parallel_size(self) -> int:
        return self.layout.dp

    def create_kwargs(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(),
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "ep": self.layout.ep,
            "cp": self.layout.cp,
        }

    def on_initialized(self, answers: list[Any]) -> None:
        self._adapter_config = answers[0].get("adapter_config")
        self.build_policies(answers[0])  # with adapters: one view per adapter (areal_fsdp.multi_adapter)
        # Pipeline stages: which (stage index, first layer, end layer) each rank runs,
        # and the parameter bytes each rank holds.
        self.rank_stages: list[list[list[int]]] = [a.get("stages", []) for a in answers]
        self.rank_param_bytes: list[int] = [int(a.get("param_bytes", 0)) for a in answers]
        # Expert parallelism: which experts each rank holds ([first, end)).
        self.rank_experts: list[list[int]] = [a.get("experts", []) for a in answers]
        moe = answers[0].get("moe_shape")
        self._moe_shape = (int(moe[0]), int(moe[1])) if moe else None
        # Tensor parallelism: whether the embedding and LM head are split by vocabulary rows.
        self.vocab_parallel = bool(answers[0].get("vocab_parallel", False))
        if answers[0].get("vocab_refusal"):
            log.warning(
                "fsdp: embedding and LM head stay replicated over the tensor ranks (every rank computes the "
                "full-vocabulary logits)", layout=str(self.layout), reason=answers[0]["vocab_refusal"],
            )  # fmt: skip
        parallel = self.layout.tp > 1 or self.layout.pp > 1 or self.layout.ep > 1 or self.layout.cp > 1
        log.info(
            "fsdp engine ready", layout=str(self.layout), logs=self.log_dir,
            wrapped_blocks=answers[0]["wrapped_blocks"], tp_layers=answers[0].get("tp_layers", 0),
            vocab_parallel=self.vocab_parallel if self.layout.tp > 1 else None,
            rank_coords={r: self.layout.rank_coords(r) for r in range(self.world_size)} if parallel else None,
            stages={r: st for r, st in enumerate(self.rank_stages)} if self.layout.pp > 1 else None,
            schedule=self.config.pipeline_schedule if self.layout.pp > 1 else None,
            experts={r: ex for r, ex in enumerate(self.rank_experts)} if self.layout.ep > 1 else None,
        )  # fmt: skip

    def call_parts(
        self,
        cmd: str,
        parts: list[TrajectoryBatch],
        per_part: list[dict[str, Any]],
        common: dict[str, Any],
    ) -> list[Any]:
        """Rank ``r`` gets part ``r // (t*p*c)`` (its replica's); tensor (or
        context) rank 0 of each replica answers for it; with pipeline stages
        the rank of the last stage answers (the others answer None)."""
        inner = self.layout.tp * self.layout.pp * self.layout.cp
        answers = self.call_ranks(
            cmd, [{"part": parts[r // inner], **per_part[r // inner], **common} for r in range(self.world_size)]
        )
        if self.layout.pp > 1:
            return [a for a in answers if a is not None]
        return answers[::inner]

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """The base class's step; with expert parallelism the ranks' summed
        router sums become the ``moe_*`` metrics (``expert_parallel.router_metrics``)."""
        out = super().train_batch(batch, loss_fn, extra)
        if self._moe_shape is not None:
            from areal_fsdp.expert_parallel import router_metrics

            out.update(router_metrics(out, *self._moe_shape))
        return out

    def state_meta(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "layout": str(self.layout)}

    def export_options(self) -> dict[str, Any]:
        # The controller's settings decide the LoRA export form (adapter or merged).
        return {"lora_export": self.config.lora.export if self.config.lora is not None else None}

    def write_disk_weights(self, path: str) -> None:
        if self.config.lora is not None:
            # The adapter alone: what the servers load beside their base weights.
            with atomic_dir(path) as tmp:
                self.call_ranks("write_adapter", {"tmp_dir": tmp})
        else:
            self.save_hf(path)

    # --------------------------------------------------------------- adapter
    def adapter_spec(self) -> AdapterSpec | None:
        """The LoRA adapter the ranks train (``actor.fsdp.lora``), or ``None``."""
        self.check_policy_call("adapter_spec")
        lora = self.config.lora
        if lora is None:
            return None
        self.require_initialized()
        return AdapterSpec(lora.name, dict(self._adapter_config or {}))
