"""``MetricSinkContract``: the suite for metric sinks (kind ``metric_sink``,
``areal_kernel.api.metric_sink``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _check_unknown_setting_is_refused, _config


class MetricSinkContract:
    """Fixture: ``sink_name`` (a name for ``logging.sinks``). Optional:
    ``sink_settings`` (your ``logging.<name>`` section, default ``{}``).
    Override ``read_back(run_dir, stdout)`` with what your sink wrote, read
    from its own output: ``{step: {metric key: value}}``."""

    TOTAL_STEPS = 3

    @pytest.fixture
    def sink_settings(self) -> dict[str, Any]:
        return {}

    def read_back(self, run_dir: str, stdout: str) -> dict[int, dict[str, Any]]:
        """The rows your sink recorded, read from its files under ``run_dir``
        (or from ``stdout``, what it printed). ``areal_kernel.testing.readback``
        has readers for the built-in sinks' formats."""
        raise NotImplementedError(
            f"{type(self).__name__} must override read_back(run_dir, stdout) -> {{step: {{key: value}}}} "
            "with what the sink wrote, read from its own output"
        )

    def _sinks(self, name: str, settings: dict, run_dir: str) -> Any:
        from areal_kernel.trainer.common import make_sinks, write_run_config

        cfg = _config({"logging": {"sinks": [name], **({name: settings} if settings else {})}})
        # As `areal train`: the run directory and its config.yaml exist before any sink is built.
        write_run_config(cfg, run_dir)
        (sink,) = make_sinks(cfg, run_dir, self.TOTAL_STEPS)
        return sink

    @staticmethod
    def _layout(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        runs = tmp_path / "runs"
        return str(cwd), str(runs), str(runs / "exp")

    def test_logs_the_metrics_it_is_given(
        self, sink_name: str, sink_settings: dict, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
    ) -> None:
        cwd, runs, run_dir = self._layout(tmp_path, monkeypatch)
        sink = self._sinks(sink_name, sink_settings, run_dir)
        # What the trainer logs: an evaluation at step 0, then steps, with
        # values that are not numbers mixed in (skip them, do not fail).
        sink.log(0, {"eval/accuracy": 0.25, "eval/reward": 0.5, "eval/n": 4})
        for step in range(1, self.TOTAL_STEPS + 1):
            sink.log(step, {
                "train/loss": 0.125 * step, "reward/mean": 0.5 + 0.0625 * step, "perf/step_s": 1.5,
                "rollout/staleness_mean": float("nan"), "note": "text", "missing": None, "hist": [1, 2],
            })  # fmt: skip
        sink.log(self.TOTAL_STEPS, {"eval/accuracy": 0.75, "eval/reward": 0.875})
        sink.close()
        rows = self.read_back(run_dir, capsys.readouterr().out)
        last = rows.get(self.TOTAL_STEPS, {})
        assert last.get("train/loss") == pytest.approx(0.125 * self.TOTAL_STEPS, abs=1e-3), rows
        assert last.get("eval/accuracy") == pytest.approx(0.75, abs=1e-3), rows
        assert rows.get(0, {}).get("eval/accuracy") == pytest.approx(0.25, abs=1e-3), rows
        # Nothing outside the run directory: not in the working directory, not beside the run.
        assert os.listdir(cwd) == [], os.listdir(cwd)
        assert os.listdir(runs) == ["exp"], os.listdir(runs)

    def test_a_resumed_run_may_log_a_step_again(
        self, sink_name: str, sink_settings: dict, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
    ) -> None:
        """A run resumed at step 1 is a new process with new sinks in the same
        run directory, and logs steps the first one may have logged."""
        _, _, run_dir = self._layout(tmp_path, monkeypatch)
        first = self._sinks(sink_name, sink_settings, run_dir)
        for step in (1, 2):
            first.log(step, {"train/loss": 1.0 * step})
        first.close()
        resumed = self._sinks(sink_name, sink_settings, run_dir)
        for step in (2, 3):
            resumed.log(step, {"train/loss": 0.5 * step})
        resumed.close()
        rows = self.read_back(run_dir, capsys.readouterr().out)
        assert rows.get(3, {}).get("train/loss") == pytest.approx(1.5, abs=1e-3), rows

    def test_close_twice(
        self, sink_name: str, sink_settings: dict, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _, _, run_dir = self._layout(tmp_path, monkeypatch)
        sink = self._sinks(sink_name, sink_settings, run_dir)
        sink.log(1, {"train/loss": 1.0})
        sink.close()
        sink.close()

    def test_unknown_setting_is_refused(self, sink_name: str) -> None:
        _check_unknown_setting_is_refused("metric_sink", sink_name, f"logging.{sink_name}")
