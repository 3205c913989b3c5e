"""``Registry.build(kind, name, ctx)``: every kind has a contract module, the
built-in targets build through it and satisfy their contracts, an object
that falls short is named (kind, name, plugin, missing members) at build
time, and a class written for the construction shape before
``from_context`` still builds, with a ``DeprecationWarning`` naming the
new shape."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from areal_kernel.api.kinds import KIND_MODULES, PluginContractError, kind_contract
from areal_kernel.api.metric_sink import MetricSink, MetricSinkContext
from areal_kernel.errors import ConfigError
from areal_kernel.plugins.registry import KINDS, FactorySpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "grpo_arithmetic.yaml")


def test_every_kind_has_a_module_with_a_frozen_context_and_a_contract():
    assert set(KIND_MODULES) == set(KINDS)
    for kind in KINDS:
        contract = kind_contract(kind)
        assert contract.kind == kind
        assert dataclasses.is_dataclass(contract.context), kind
        params = getattr(contract.context, "__dataclass_params__")
        assert params.frozen, f"{kind}: {contract.context.__qualname__} is not frozen"
        assert contract.contract_name.startswith("areal_kernel."), kind


# -- test doubles registered the way a plugin's hook registers them ---------------


class OldShapeSink:
    """A sink written for ``Sink(run_dir, total_steps=..., **settings)`` without the base class."""

    def __init__(self, run_dir: str, *, total_steps: int | None = None) -> None:
        self.run_dir, self.total_steps = run_dir, total_steps

    def log(self, step, metrics):
        pass

    def close(self):
        pass


class NewShapeSink(MetricSink):
    def __init__(self, run_dir: str, *, total_steps: int | None = None) -> None:
        self.run_dir, self.total_steps = run_dir, total_steps

    def log(self, step, metrics):
        pass


class NoCloseSink:
    @classmethod
    def from_context(cls, context):
        return cls()

    def log(self, step, metrics):
        pass


class HalfParser:
    stop_strings = ("</call>",)  # parse() is missing


def not_a_directory(variant):
    return None


NOT_CALLABLE = 42


@pytest.fixture
def registered(areal_env):
    from areal_kernel.plugins import get_registry

    areal_env()
    reg = get_registry()
    for kind, name, attr in [
        ("metric_sink", "old_shape", "OldShapeSink"),
        ("metric_sink", "new_shape", "NewShapeSink"),
        ("metric_sink", "no_close", "NoCloseSink"),
        ("tool_parser", "half", "HalfParser"),
        ("model_source", "nowhere", "not_a_directory"),
        ("loss", "not_callable", "NOT_CALLABLE"),
    ]:
        reg.add(FactorySpec(kind=kind, name=name, target=f"{__name__}:{attr}", plugin="testbuild"))
    return reg


def test_old_construction_shape_builds_with_a_deprecation_warning(registered, tmp_path):
    ctx = MetricSinkContext(name="old_shape", run_dir=str(tmp_path), total_steps=5)
    with pytest.warns(DeprecationWarning) as caught:
        sink = registered.build("metric_sink", "old_shape", ctx)
    assert isinstance(sink, OldShapeSink) and sink.total_steps == 5
    (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    message = str(w.message)
    for fragment in (
        "metric_sink 'old_shape'",
        "plugin 'testbuild'",
        "from_context",
        "areal_kernel.api.metric_sink.MetricSink",
    ):
        assert fragment in message, message
    # The warning points at the caller of Registry.build, not at the kernel's helper.
    assert w.filename == __file__


def test_a_subclass_of_the_base_builds_without_a_warning(registered, tmp_path):
    ctx = MetricSinkContext(name="new_shape", run_dir=str(tmp_path), total_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink = registered.build("metric_sink", "new_shape", ctx)
    assert isinstance(sink, NewShapeSink) and sink.run_dir == str(tmp_path) and sink.total_steps == 3


@pytest.mark.parametrize(
    "kind, name, ctx_factory, fragments",
    [
        (
            "metric_sink", "no_close",
            lambda tmp: MetricSinkContext(name="no_close", run_dir=tmp),
            ["metric_sink 'no_close' (plugin 'testbuild')", "a NoCloseSink", "lacks close", "MetricSink"],
        ),
        (
            "tool_parser", "half",
            lambda tmp: __import__("areal_kernel.api.tool_parser", fromlist=["x"]).ToolParserContext("half"),
            ["tool_parser 'half' (plugin 'testbuild')", "a HalfParser", "lacks parse", "ToolCallParser"],
        ),
        (
            "loss", "not_callable",
            lambda tmp: __import__("areal_kernel.api.loss", fromlist=["x"]).LossContext("not_callable"),
            ["loss 'not_callable' (plugin 'testbuild')", "is not callable", "PolicyLoss"],
        ),
        (
            "model_source", "nowhere",
            lambda tmp: __import__("areal_kernel.api.model_source", fromlist=["x"]).ModelSourceContext("nowhere", "v1"),
            ["model_source 'nowhere' (plugin 'testbuild')", "returned NoneType None for variant 'v1'"],
        ),
    ],
)  # fmt: skip
def test_an_object_that_falls_short_is_named_at_build_time(registered, tmp_path, kind, name, ctx_factory, fragments):
    with pytest.raises(PluginContractError) as err:
        registered.build(kind, name, ctx_factory(str(tmp_path)))
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, message
    # A user-facing error (one line, exit 2), caught where ConfigError was.
    assert isinstance(err.value, ConfigError) and "\n" not in message


def test_where_names_the_field_for_lookup_and_contract_errors(registered):
    from areal_kernel.api.tool_parser import ToolParserContext

    with pytest.raises(ConfigError, match=r"^proxy.tool_parser: no tool_parser named 'hermez'.*Did you mean 'hermes'"):
        registered.build("tool_parser", "hermez", ToolParserContext("hermez"), where="proxy.tool_parser")
    with pytest.raises(PluginContractError, match=r"^proxy.tool_parser: tool_parser 'half'"):
        registered.build("tool_parser", "half", ToolParserContext("half"), where="proxy.tool_parser")


def test_a_context_of_another_kind_is_refused(registered, tmp_path):
    from areal_kernel.api.tool_parser import ToolParserContext

    with pytest.raises(
        TypeError, match=r"ctx must be a areal_kernel.api.metric_sink.MetricSinkContext, got ToolParserContext"
    ):
        registered.build("metric_sink", "new_shape", ToolParserContext("new_shape"))


def test_builtins_build_through_their_contracts(areal_env, tmp_path):
    """One built-in of each kind that builds without servers or a model."""
    from areal_kernel.api.advantage_estimator import AdvantageEstimatorContext
    from areal_kernel.api.dataset import DatasetContext
    from areal_kernel.api.loss import LossContext
    from areal_kernel.api.platform import Platform, PlatformContext
    from areal_kernel.api.reward import RewardContext
    from areal_kernel.api.scheduler import Scheduler, SchedulerContext
    from areal_kernel.api.tool import ToolContext
    from areal_kernel.api.tool_parser import ToolParserContext
    from areal_kernel.api.trainer import Trainer, TrainerContext
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    areal_env()
    reg = get_registry()
    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path / 'run'}"], registry=reg)
    assert isinstance(reg.build("platform", "cpu", PlatformContext("cpu"), platform=""), Platform)
    sched = reg.build("scheduler", "local", SchedulerContext("local", cfg))
    assert isinstance(sched, Scheduler) and sched.config is cfg
    sched.stop()
    sink = reg.build("metric_sink", "jsonl", MetricSinkContext("jsonl", str(tmp_path), total_steps=2, config=cfg))
    sink.log(1, {"x": 1.0})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    reward = reg.build("reward", cfg.reward.type, RewardContext(cfg.reward.type, cfg.reward.plugin_config))
    answer = "42"
    assert reward(answer, answer) == reward.success_threshold == 1.0
    assert reward("no number here", answer) < reward.success_threshold
    assert callable(reg.build("advantage_estimator", "grpo", AdvantageEstimatorContext("grpo")))
    assert callable(reg.build("loss", "ppo", LossContext("ppo")))
    parser = reg.build("tool_parser", "hermes", ToolParserContext("hermes"))
    assert parser.stop_strings
    tool = reg.build("tool", "calculator", ToolContext("calculator"))
    assert tool.description
    data = reg.build(
        "dataset", cfg.dataset.type, DatasetContext(cfg.dataset.type, cfg.dataset, cfg.seed, ("prompt", "answer"))
    )
    assert data.train and {"prompt", "answer", "id"} <= set(data.train[0])
    trainer = reg.build("trainer", "grpo", TrainerContext.for_config(cfg))
    assert isinstance(trainer, Trainer)


def test_inference_engine_defaults_name_the_member_and_the_feature():
    from areal_kernel.api.engine import InferenceEngine

    class Minimal(InferenceEngine):
        async def agenerate(self, req):
            raise AssertionError("not called")

        def get_version(self):
            return 0

        def pause(self):
            pass

        def resume(self):
            pass

        def update_weights(self, meta):
            pass

    engine = Minimal()
    with pytest.raises(
        NotImplementedError,
        match=r"Minimal does not implement InferenceEngine.resync_server, which rollout.restart_servers",
    ):
        engine.resync_server("127.0.0.1:1")
    with pytest.raises(NotImplementedError, match=r"init_weight_group_async, which weight_update.mode: broadcast"):
        engine.init_weight_group_async("127.0.0.1", 1, "g", "gloo")
    # An attribute an engine without a weight group does not have (hasattr stays usable).
    assert not hasattr(engine, "weight_group_world_size")


class OldShapeWorkflow:
    """A workflow written for the five keywords, without the base class."""

    reward_calls = reward_failures = 0

    def __init__(self, *, tokenizer, gconfig, reward_target, reward_pool, config):
        self.args = (tokenizer, gconfig, reward_target, reward_pool, config)

    async def arun_episode(self, engine, record):
        return None

    async def aevaluate(self, engine, record, max_new_tokens):
        return 0.0, ""


class OldShapeTransport:
    name = "old"

    def __init__(self, train_engine, inference_engine, run_dir, bucket_bytes):
        self.args = (train_engine, inference_engine, run_dir, bucket_bytes)

    def setup(self):
        pass

    def update(self, version):
        return {}


class OldShapeBackend:
    launcher = None

    def __init__(self, config):
        self.args = (config,)

    def place(self, scheduler, placements):
        pass

    def launch(self, model_dir, device_plan, run_dir):
        return []

    def make_client(self, addresses):
        return None

    def stop(self):
        pass


def _old_shape_cases():
    from areal_kernel.api.inference_engine import InferenceBackendContext
    from areal_kernel.api.io import GenerationConfig
    from areal_kernel.api.reward import Reward
    from areal_kernel.api.weight_transport import WeightTransportContext
    from areal_kernel.api.workflow import WorkflowContext

    reward = Reward(name="r", target="pkg.mod:fn", plugin="p", fn=len)
    gconfig = GenerationConfig()
    return [
        (
            "workflow", "OldShapeWorkflow", "areal_kernel.api.workflow.Workflow",
            WorkflowContext(name="old", tokenizer="tok", gconfig=gconfig, reward=reward, reward_pool="pool", settings="s"),
            ("tok", gconfig, "pkg.mod:fn", "pool", "s"),
        ),
        (
            "weight_transport", "OldShapeTransport", "areal_kernel.api.weight_transport.WeightTransport",
            WeightTransportContext(name="old", train_engine="te", inference_engine="ie", run_dir="rd", bucket_bytes=7),
            ("te", "ie", "rd", 7),
        ),
        (
            "inference_engine", "OldShapeBackend", "areal_kernel.inference.backend.InferenceBackend",
            InferenceBackendContext(name="old", config="cfg"),
            ("cfg",),
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(3))
def test_every_class_kind_keeps_its_old_shape_with_a_warning(areal_env, case):
    from areal_kernel.plugins import get_registry

    kind, attr, base, ctx, expected_args = _old_shape_cases()[case]
    areal_env()
    reg = get_registry()
    reg.add(FactorySpec(kind=kind, name="old", target=f"{__name__}:{attr}", plugin="testbuild"))
    with pytest.warns(DeprecationWarning, match=f"subclass {base}"):
        built = reg.build(kind, "old", ctx)
    assert type(built).__name__ == attr and built.args == expected_args
