"""One line per registry kind: how a user selects it, what its target must
be, where the kernel calls it and which contract suite checks it.

The table "Every kind in one place" of docs/plugin-authoring.md is this
table, cell for cell (a test compares them), so the two cannot drift. Cells
are markdown as the page shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_kernel.hookspecs import REGISTRATION_HOOKS


@dataclass(frozen=True)
class KindDoc:
    kind: str  # the registry kind (a key of REGISTRATION_HOOKS)
    label: str  # what the docs call it
    selected_by: str
    target: str
    called_in: str
    suite: str  # a class of areal_kernel.testing, or "none (<why>)"

    @property
    def hook(self) -> str:
        return REGISTRATION_HOOKS[self.kind]

    def cells(self) -> list[str]:
        """The row of the docs table."""
        suite = self.suite if self.suite.startswith("none") else f"`{self.suite}`"
        return [f"{self.label} (`{self.hook}`)", self.selected_by, self.target, self.called_in, suite]


KIND_DOCS: tuple[KindDoc, ...] = (
    KindDoc(
        "train_engine",
        "train engine",
        "`actor.backend`",
        "a `TrainEngine` subclass (`areal_kernel.api.engine`) built as `Engine.from_context(ctx)` (a "
        "`TrainEngineContext`: its validated `actor.<name>` section, the whole config, allocation, platform, run "
        "directory, scheduler; see [Train engines](#train-engines)), then `initialize`, `compute_logprobs`, "
        "`train_batch` (the loss contract of `areal_kernel.engine.torch_engine`), `save_hf`, `send_weights`",
        "controller (ranks: yours)",
        "TrainEngineContract",
    ),
    KindDoc(
        "inference_engine",
        "inference engine",
        "`rollout.backend`",
        "a backend built as `Backend(config)` with `launch(model_dir, device_plan, run_dir) -> addresses`, "
        "`make_client(addresses)` (an `InferenceEngine`) and `stop()`",
        "controller (servers: yours)",
        "InferenceEngineContract",
    ),
    KindDoc(
        "weight_transport",
        "weight transport",
        "`weight_update.mode`, via `areal_select_weight_transport`",
        "[Weight transports](#weight-transports)",
        "controller",
        "WeightTransportContract",
    ),
    KindDoc(
        "scheduler",
        "scheduler",
        "`scheduler.type`",
        "[Schedulers](#schedulers)",
        "controller",
        "SchedulerContract",
    ),
    KindDoc(
        "platform",
        "platform",
        "`AREAL_PLATFORM` or a probe",
        "a `Platform` subclass ([The `Platform` interface](#the-platform-interface))",
        "every process",
        "PlatformContract",
    ),
    KindDoc("dataset", "dataset", "`dataset.type`", "[Datasets](#datasets)", "controller", "DatasetContract"),
    KindDoc("reward", "reward", "`reward.type`", "[Rewards](#rewards)", "reward worker processes", "RewardContract"),
    KindDoc(
        "workflow",
        "workflow",
        "`workflow.type`",
        "[Workflows](#workflows)",
        "controller (asyncio loop)",
        "WorkflowContract",
    ),
    KindDoc(
        "advantage_estimator",
        "advantage estimator",
        "`algorithm.advantage`",
        "[Advantage estimators and losses](#advantage-estimators-and-losses)",
        "controller",
        "AdvantageEstimatorContract",
    ),
    KindDoc(
        "loss",
        "loss",
        "`algorithm.loss`",
        "[Advantage estimators and losses](#advantage-estimators-and-losses)",
        "wherever the train engine computes",
        "LossContract",
    ),
    KindDoc(
        "metric_sink",
        "metric sink",
        "`logging.sinks`",
        "[Metric sinks](#metric-sinks)",
        "controller",
        "MetricSinkContract",
    ),
    KindDoc(
        "model_source",
        "model source",
        "`model.path`",
        "`fn(variant: str \\| None) -> str`, a local HF directory",
        "controller",
        "none (a function of one string)",
    ),
    KindDoc(
        "trainer",
        "trainer",
        "`algorithm.type`",
        "a `Trainer` subclass (`areal_kernel.api.trainer`) built as `factory(context)` with a `TrainerContext`, "
        "then `setup()`, `train()`, `close(status)`; see [Trainers](#trainers)",
        "controller",
        "none yet (test it with `run_areal`: `areal train` on your trainer)",
    ),
    KindDoc(
        "tool_parser",
        "tool-call parser",
        "`workflow.multi_turn.tool_parser` (and the proxy, by name)",
        "a zero-argument class satisfying `areal_kernel.tools.ToolCallParser`; see "
        "[Tools and tool-call parsers](#tools-and-tool-call-parsers)",
        "controller (asyncio loop)",
        "ToolParserContract",
    ),
    KindDoc(
        "tool",
        "tool",
        "`workflow.multi_turn.tools`",
        "a class built as `Tool(**settings)` satisfying `areal_kernel.tools.Tool`; see "
        "[Tools and tool-call parsers](#tools-and-tool-call-parsers)",
        "controller (asyncio loop)",
        "ToolContract",
    ),
)
