"""Metric sinks may declare settings: ``logging.<sink name>: {...}`` is
validated against the sink's registered config_model and arrives at its
constructor as keywords, next to ``run_dir`` and ``total_steps``."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.metric_sink import MetricSink

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "grpo_arithmetic.yaml")


class RecorderSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = "rec"
    every: int = Field(1, ge=1)


class Recorder(MetricSink):
    """A sink with settings, built the way the kernel builds every sink."""

    def __init__(self, run_dir: str, *, total_steps: int | None = None, prefix: str, every: int) -> None:
        self.args = {"run_dir": run_dir, "total_steps": total_steps, "prefix": prefix, "every": every}

    def log(self, step: int, metrics: dict) -> None:
        pass


@pytest.fixture
def recorder_registered(areal_env):
    """``recorder`` registered the way a plugin's hook would register it."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.registry import FactorySpec

    areal_env()
    get_registry().add(
        FactorySpec(
            kind="metric_sink", name="recorder", target=f"{__name__}:Recorder", plugin="testsink",
            config_model=f"{__name__}:RecorderSettings",
        )
    )  # fmt: skip


def test_sink_settings_are_validated_and_reach_the_constructor(recorder_registered, tmp_path):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.common import make_sinks

    cfg = load_config(EXAMPLE, ["logging.sinks=[jsonl, recorder]", "logging.recorder={prefix: x, every: '3'}"], registry=get_registry())
    assert cfg.logging.sink_settings("recorder") == RecorderSettings(prefix="x", every=3)
    jsonl, rec = make_sinks(cfg, str(tmp_path), 7)
    assert rec.args == {"run_dir": str(tmp_path), "total_steps": 7, "prefix": "x", "every": 3}
    jsonl.close()
    # No section: the model's defaults arrive (the only defaults there are).
    cfg = load_config(EXAMPLE, ["logging.sinks=[recorder]"], registry=get_registry())
    (rec,) = make_sinks(cfg, str(tmp_path), 2)
    assert rec.args["prefix"] == "rec" and rec.args["every"] == 1


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["logging.recorder={every: 0}"], ("logging.recorder.every", "greater than or equal to 1")),
        (["logging.recorder={every: often}"], ("logging.recorder.every", "valid integer")),
        (["logging.recorder={prefx: a}"], ("logging.recorder.prefx", "unknown key", "did you mean 'prefix'")),
        (["logging.recordr={prefix: a}"], ("logging.recordr", "unknown key", "did you mean 'recorder'")),
        (["logging.sinks=[recorder, jsonl]", "logging.jsonl={path: x}"], ("logging.jsonl", "metric_sink 'jsonl' takes no settings")),
        (["logging.sinks=[console]"], ("logging.recorder", "unknown key", "logging.sinks: console")),
    ],
)
def test_bad_sink_settings_are_one_error_naming_the_field(recorder_registered, overrides, fragments):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["logging.sinks=[recorder]", "logging.recorder={prefix: a}", *overrides], registry=get_registry())
    msg = str(info.value)
    assert len(msg.splitlines()) == 1, msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_builtin_sinks_take_the_constructor_contract(tmp_path):
    """Every built-in sink is built as ``Sink(run_dir, total_steps=N)``, like a plugin's."""
    from areal_kernel.metrics.sinks import ConsoleSink, JsonlSink

    JsonlSink(str(tmp_path), total_steps=3).close()
    assert ConsoleSink(str(tmp_path), total_steps=3).total == 3


def test_console_says_once_what_each_reward_is():
    import io

    from areal_kernel.metrics.sinks import ConsoleSink

    out = io.StringIO()
    sink = ConsoleSink(None, total_steps=2, stream=out)
    step = {"rollout/reward_mean": 0.893, "reward/mean": 0.719, "rollout/staleness_mean": 0.0, "train/loss": 0.1}
    sink.log(1, step)
    sink.log(2, {**step, "rollout/reward_mean": float("nan")})
    lines = out.getvalue().splitlines()
    legend, steps = lines[:3], lines[3:]
    assert len(steps) == 2, lines  # a line per explained label, once, then one line per step
    assert legend[0].startswith("  sampled_reward: mean reward of every answer sampled since the last step, dropped "
                                "groups included"), lines  # fmt: skip
    assert legend[1].startswith("  trained_reward: mean reward of the batch this step trained on"), lines
    assert legend[2].startswith("  stale: "), lines
    assert "sampled_reward 0.893  trained_reward 0.719" in steps[0]
    assert "sampled_reward -  trained_reward 0.719" in steps[1]  # no sample finished between the steps


def test_wandb_settings_validate_without_importing_wandb(areal_env):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from areal_kernel.config.loader import load_config\n"
        "from areal_kernel.plugins import get_registry\n"
        f"c = load_config({EXAMPLE!r}, ['logging.sinks=[wandb]', 'logging.wandb={{project: p, mode: offline}}'], "
        "registry=get_registry())\n"
        "assert c.logging.sink_settings('wandb').mode == 'offline'\n"
        "assert 'wandb' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
