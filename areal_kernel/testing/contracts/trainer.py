"""``TrainerContract``: the suite for trainers (kind ``trainer``,
``areal_kernel.api.trainer``)."""

from __future__ import annotations

import json
import math
import os
import signal
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _TYPO_KEY, _config, _spec


def _origin(name: str) -> str:
    """``trainer 'x' of plugin 'p' (dist version)``: who to blame in a failure message."""
    from areal_kernel.plugins.blame import spec_origin

    return spec_origin(_spec("trainer", name))


class TrainerContract:
    """Fixtures: ``trainer_name`` (a name registered with
    ``areal_register_trainers``) and ``trainer_config`` (the rest of a
    config, as a user writes it, that makes a short run of it: a tiny model,
    a few steps; ``algorithm.type`` and ``run_dir`` are set by the suite).
    Optional: ``trainer_settings`` (your ``algorithm.<name>`` section,
    default ``{}``).

    The suite builds the trainer as ``areal train`` does
    (``Registry.build("trainer", name, TrainerContext.for_config(cfg))``,
    the config validated and resolved against the registry) and checks the
    contract of ``areal_kernel.api.trainer``: the constructor does no work,
    ``close`` works whatever ``setup`` got to (also when it never ran), a
    whole run under the kernel's driver (``run_trainer``) writes
    ``config.yaml``, ``result.json`` (a JSON object) and the metrics of its
    steps through ``logging.sinks`` (numbers, steps from 1 on), and
    ``close`` is called once with ``completed``; a misspelt key in
    ``algorithm.<name>`` is refused naming it. Failures name the trainer
    and its plugin."""

    @pytest.fixture
    def trainer_settings(self) -> dict[str, Any]:
        return {}

    def _cfg(self, name: str, config: dict[str, Any], settings: dict[str, Any], run_dir: str) -> Any:
        data = {k: v for k, v in config.items() if k not in ("run_dir",)}
        algorithm = {**data.get("algorithm", {}), "type": name}
        if settings:
            algorithm[name] = settings
        logging = {**data.get("logging", {})}
        # The suite reads the steps back from metrics.jsonl: the jsonl sink is always among the sinks.
        logging["sinks"] = sorted({*logging.get("sinks", []), "jsonl"})
        return _config({**data, "algorithm": algorithm, "logging": logging, "run_dir": run_dir})

    def _build(self, cfg: Any) -> Any:
        from areal_kernel.api.trainer import TrainerContext
        from areal_kernel.plugins import get_registry

        ctx = TrainerContext.for_config(cfg)
        return get_registry().build("trainer", ctx.name, ctx)

    def test_the_constructor_does_no_work(
        self, trainer_name: str, trainer_config: dict, trainer_settings: dict, tmp_path: Any
    ) -> None:
        """The kernel builds the trainer before it sets up error reporting
        into ``run_dir``: building must create nothing there."""
        run_dir = str(tmp_path / "run")
        cfg = self._cfg(trainer_name, trainer_config, trainer_settings, run_dir)
        trainer = self._build(cfg)
        assert not os.path.exists(run_dir), (
            f"{_origin(trainer_name)}: its constructor wrote into run_dir ({sorted(os.listdir(run_dir))}); "
            "only store what you are given there, do the work in setup()"
        )
        trainer.close("failed")

    def test_close_without_setup(
        self, trainer_name: str, trainer_config: dict, trainer_settings: dict, tmp_path: Any
    ) -> None:
        """``setup`` may fail before it built anything: ``close`` must still
        work (it releases only what was built)."""
        cfg = self._cfg(trainer_name, trainer_config, trainer_settings, str(tmp_path / "run"))
        trainer = self._build(cfg)
        try:
            trainer.close("failed")
        except Exception as e:
            pytest.fail(
                f"{_origin(trainer_name)}: close('failed') before setup() raised {type(e).__name__}: {e}; "
                "close() must release only what setup() built (setup may fail half-way)"
            )

    def test_a_run_writes_its_result_and_metrics_and_closes_once(
        self, trainer_name: str, trainer_config: dict, trainer_settings: dict, tmp_path: Any
    ) -> None:
        from areal_kernel.api.trainer import TrainerContext
        from areal_kernel.plugins import get_registry
        from areal_kernel.testing.readback import jsonl_rows
        from areal_kernel.trainer.common import run_trainer

        who = _origin(trainer_name)
        run_dir = str(tmp_path / "run")
        cfg = self._cfg(trainer_name, trainer_config, trainer_settings, run_dir)
        closed: list[str] = []

        def factory(ctx: TrainerContext) -> Any:
            trainer = get_registry().build("trainer", ctx.name, ctx)
            close = trainer.close

            def recorded_close(status: str) -> None:
                closed.append(status)
                close(status)

            trainer.close = recorded_close  # type: ignore[method-assign]
            return trainer

        # run_trainer installs the kernel's SIGINT/SIGTERM handlers, as areal train does: put pytest's back after.
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = run_trainer(factory, TrainerContext.for_config(cfg))
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        assert code == 0, f"{who}: run_trainer returned {code}"
        assert closed == ["completed"], f"{who}: close() was called with {closed}, expected once with 'completed'"
        result_path = os.path.join(run_dir, "result.json")
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
        assert isinstance(result, dict), f"{who}: train() returned {type(result).__name__}; return a dict"
        assert os.path.isfile(os.path.join(run_dir, "config.yaml")), (
            f"{who}: no config.yaml in run_dir; call write_run_config(cfg, run_dir) in setup()"
        )
        rows = jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
        steps = sorted(s for s in rows if s >= 1)
        assert steps, (
            f"{who}: no step >= 1 reached metrics.jsonl ({sorted(rows)}); log each step's metrics "
            "through the sinks of logging.sinks (open_metric_sinks / make_sinks)"
        )
        assert steps == list(range(1, steps[-1] + 1)), f"{who}: steps logged {steps}, expected 1..{steps[-1]}"
        for step in steps:
            values = rows[step]
            assert values, f"{who}: step {step} logged no metric"
            bad = {k: v for k, v in values.items() if not isinstance(v, (int, float)) or math.isinf(v)}
            assert not bad, f"{who}: step {step} logged values that are not finite numbers or NaN: {bad}"

    def test_unknown_setting_is_refused(self, trainer_name: str, trainer_config: dict, tmp_path: Any) -> None:
        """``algorithm.<name>: {<misspelt key>: 1}`` is one ``ConfigError``
        naming the section: refused by your ``config_model`` (give it
        ``extra="forbid"``), or as a section for a trainer that takes none."""
        from areal_kernel.errors import ConfigError

        where = f"algorithm.{trainer_name}"
        try:
            self._cfg(trainer_name, trainer_config, {_TYPO_KEY: 1}, str(tmp_path / "run"))
        except ConfigError as e:
            assert where in str(e), f"{_origin(trainer_name)}: the error must name {where!r}: {e}"
            return
        pytest.fail(
            f"{_origin(trainer_name)}: {where}: {{{_TYPO_KEY}: 1}} was accepted; a misspelt setting must be an "
            "error. Give the trainer's config_model model_config = ConfigDict(extra='forbid')"
        )
