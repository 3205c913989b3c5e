"""Contract suites for datasets, metric sinks, advantage estimators, losses,
workflows, weight transports, schedulers, tool-call parsers and tools.

A plugin's tests subclass one per registered part and name it with a fixture::

    import pytest
    from areal_kernel.testing import DatasetContract

    class TestMyDataset(DatasetContract):
        @pytest.fixture
        def dataset_name(self):
            return "mydata"            # dataset.type: mydata

        @pytest.fixture
        def dataset_settings(self):
            return {"n": 64}           # dataset.mydata: {n: 64}

Each suite builds the part exactly as the kernel does (through the registry,
with settings validated against the registered ``config_model``) and checks
what the kernel relies on; docs/plugin-authoring.md ("Testing your plugin")
lists the fixtures of each. Real parts throughout: the kernel's torch train
engine and embedded inference server on tiny models, real reward worker
processes, real files and subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest

# A settings key no part declares: a config_model must refuse it.
_TYPO_KEY = "areal_contract_no_such_setting"
# A keyword no kernel version passes: estimators and losses must ignore it.
_EXTRA_KEYWORD = "areal_contract_future_keyword"


def _spec(kind: str, name: str) -> Any:
    from areal_kernel.plugins import get_registry

    return get_registry().get(kind, name)


def _build(kind: str, name: str, ctx: Any) -> Any:
    """``name`` of ``kind`` built the way the kernel builds it (``Registry.build``:
    the kind's factory shape, then its contract checked)."""
    from areal_kernel.plugins import get_registry

    return get_registry().build(kind, name, ctx)


def _config(data: dict[str, Any]) -> Any:
    """An ``ExperimentConfig`` validated from ``data`` as ``areal train`` validates a file."""
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry

    return validate_config(data, "contract config", get_registry())


def _section(name: str, settings: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    out = dict(fields)
    if settings:
        out[name] = settings
    return out


def _check_unknown_setting_is_refused(kind: str, name: str, where: str) -> None:
    """A misspelt key under ``where`` must be a ``ConfigError`` naming it."""
    from areal_kernel.config.sections import validate_settings
    from areal_kernel.errors import ConfigError

    try:
        validate_settings(where, kind, name, {_TYPO_KEY: 1}, spec=_spec(kind, name))
    except ConfigError as e:
        msg = str(e)
        assert where in msg, f"the error must name the section {where!r}: {msg}"
        return
    pytest.fail(
        f"{where}: {{{_TYPO_KEY}: 1}} was accepted; a misspelt setting must be an error. Give the "
        f"config_model of {kind} '{name}' model_config = ConfigDict(extra='forbid')"
    )


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


# ---------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------

_LOAD_IN_CHILD = textwrap.dedent(
    """
    import json, sys
    from areal_kernel.config.loader import validate_config
    from areal_kernel.data.contract import load_dataset
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.components import workflow_required_fields

    cfg = validate_config(json.loads(sys.argv[1]), "contract config", get_registry())
    required = workflow_required_fields(cfg)
    spec = get_registry().get("dataset", cfg.dataset.type)
    train, evals = load_dataset(spec, cfg.dataset, cfg.seed, required, "the contract")
    sys.stdout.write(json.dumps([train, evals], sort_keys=True, default=repr))
    """
)


class DatasetContract:
    """Fixture: ``dataset_name`` (your ``dataset.type``). Optional:
    ``dataset_settings`` (your ``dataset.<name>`` section, default ``{}``),
    ``dataset_section`` (other ``dataset`` keys, e.g. ``{"path": ...}``,
    default ``{}``) and ``dataset_workflow`` (the workflow whose
    ``required_fields`` the records must carry, default ``rlvr``). Set the
    class attribute ``has_eval = False`` if your source holds out nothing
    under these settings (the suite checks that too)."""

    has_eval: bool = True
    SEED = 3

    @pytest.fixture
    def dataset_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def dataset_section(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def dataset_workflow(self) -> str:
        return "rlvr"

    def _cfg_data(self, name: str, settings: dict, section: dict, workflow: str, seed: int) -> dict[str, Any]:
        return {
            "seed": seed,
            "dataset": _section(name, settings, type=name, **section),
            "workflow": {"type": workflow},
        }

    def _load(self, cfg_data: dict[str, Any]) -> tuple[list[dict], list[dict], tuple[str, ...]]:
        from areal_kernel.data.contract import load_dataset
        from areal_kernel.trainer.components import workflow_required_fields

        cfg = _config(cfg_data)
        required = workflow_required_fields(cfg)
        train, evals = load_dataset(_spec("dataset", cfg.dataset.type), cfg.dataset, cfg.seed, required, "the contract")
        return train, evals, required

    def test_records_carry_what_the_workflow_reads(
        self, dataset_name: str, dataset_settings: dict, dataset_section: dict, dataset_workflow: str
    ) -> None:
        train, evals, required = self._load(
            self._cfg_data(dataset_name, dataset_settings, dataset_section, dataset_workflow, self.SEED)
        )
        assert train, "the source produced no training records"
        for rec in train + evals:
            for f in required:
                assert rec.get(f) not in (None, "", [], {}), (f, rec)
            assert isinstance(rec["id"], str) and rec["id"], rec
        ids = [r["id"] for r in train + evals]
        # Samples are grouped (and their advantages normalised) by id; an
        # eval record sharing a training id would be reported as trained on.
        assert len(ids) == len(set(ids)), "ids repeat across the train and eval records"

    def test_eval_records_are_held_out(
        self, dataset_name: str, dataset_settings: dict, dataset_section: dict, dataset_workflow: str
    ) -> None:
        train, evals, required = self._load(
            self._cfg_data(dataset_name, dataset_settings, dataset_section, dataset_workflow, self.SEED)
        )
        assert bool(evals) == self.has_eval, (
            f"{len(evals)} eval records, but the class declares has_eval={self.has_eval}"
        )

        def content(rec: dict) -> str:
            return json.dumps({f: rec[f] for f in required}, sort_keys=True, default=repr)

        seen = {content(r) for r in train}
        leaked = [r["id"] for r in evals if content(r) in seen]
        assert not leaked, f"eval records that are also training records (same {list(required)}): {leaked[:5]}"

    def test_same_seed_gives_the_same_records_in_any_process(
        self, dataset_name: str, dataset_settings: dict, dataset_section: dict, dataset_workflow: str
    ) -> None:
        """A resumed run is a new process: it must see the records (and the
        split) the first one saw, whatever the string hash seed."""
        cfg_data = self._cfg_data(dataset_name, dataset_settings, dataset_section, dataset_workflow, self.SEED)
        first = self._load(cfg_data)[:2]
        again = self._load(cfg_data)[:2]
        dump = json.dumps(list(first), sort_keys=True, default=repr)
        assert json.dumps(list(again), sort_keys=True, default=repr) == dump, "two loads with one seed differ"
        env = dict(os.environ, PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
        # This process's import path, so a plugin installed for the test is found there too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD_IN_CHILD, json.dumps(cfg_data)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == dump, "another process loaded different records for the same seed"

    def test_unknown_setting_is_refused(self, dataset_name: str) -> None:
        _check_unknown_setting_is_refused("dataset", dataset_name, f"dataset.{dataset_name}")


# ---------------------------------------------------------------------------
# Metric sinks
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------

# group -> rewards; "b" is constant (nothing to learn), "c" is strictly ordered.
_GROUPS: dict[str, list[float]] = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.5, 0.5, 0.5, 0.5], "c": [0.0, 1.0, 0.25, 0.75]}


def _trajectories(groups: dict[str, list[float]], *, equal_lengths: bool = False) -> Any:
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    trajs = []
    for g, rewards in groups.items():
        for i, r in enumerate(rewards):
            prompt, gen = 3, 4 if equal_lengths else 2 + (i * 3 + len(g)) % 5
            ids = [7] * prompt + [11 + i] * gen
            trajs.append(
                Trajectory(
                    ids,
                    [0] * prompt + [1] * gen,
                    [0.0] * prompt + [-0.5] * gen,
                    [-1] * prompt + [0] * gen,
                    reward=r,
                    group_id=g,
                )
            )
    return TrajectoryBatch(trajs)


class AdvantageEstimatorContract:
    """Fixture: ``estimator_name`` (your ``algorithm.advantage``). Optional:
    ``estimator_settings`` (your ``algorithm.<name>`` section, default
    ``{}``) and ``estimator_settings_alt`` (other settings that must change
    the advantages; default ``None``: not checked). Set the class attribute
    ``group_relative = False`` if a group's advantages depend on other groups
    or on the level of its rewards (batch normalisation, a critic): the suite
    checks the declaration both ways."""

    group_relative: bool = True

    @pytest.fixture
    def estimator_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def estimator_settings_alt(self) -> dict[str, Any] | None:
        return None

    @staticmethod
    def _values(batch: Any, zero: bool = False) -> list[list[float]]:
        rng = random.Random(0)
        return [[0.0 if zero else rng.uniform(-1, 1) for _ in t.input_ids] for t in batch.trajectories]

    def _advantages(
        self, name: str, settings: dict | None, batch: Any, *, zero_values: bool = False,
        values: list[list[float]] | None = None, **knobs: Any,
    ) -> tuple[list[list[float]], Any]:  # fmt: skip
        """``compute_advantages`` as the trainer calls it: registry, knobs,
        validated settings; critic ``values`` for an estimator that needs them."""
        from areal_kernel.algo.rl import RLConfig, compute_advantages

        cfg = RLConfig(advantage=name, advantage_settings=settings or None, **knobs)
        if values is None and "needs_values" in _spec("advantage_estimator", name).capabilities:
            values = self._values(batch, zero_values)
        ref = None
        if cfg.kl_in == "reward" and cfg.kl_coef > 0:
            ref = [[lp - 0.1 * m for lp, m in zip(t.logprobs, t.loss_mask)] for t in batch.trajectories]
        return compute_advantages(batch, cfg, values=values, ref_logprobs=ref)

    def test_one_finite_advantage_per_loss_token(self, estimator_name: str, estimator_settings: dict) -> None:
        batch = _trajectories(_GROUPS)
        rows, returns = self._advantages(estimator_name, estimator_settings, batch)
        assert [len(r) for r in rows] == [len(t.input_ids) for t in batch.trajectories]
        if "needs_values" in _spec("advantage_estimator", estimator_name).capabilities:
            # The critic is trained on these: one finite target per token.
            assert returns is not None, "an estimator with needs_values must return AdvantageResult(returns=...)"
            assert [len(r) for r in returns] == [len(t.input_ids) for t in batch.trajectories]
            assert all(_finite(x) for row in returns for x in row)
        assert any(x != 0.0 for row in rows for x in row), "every advantage is 0 for rewards that differ"

    def test_equal_rewards_give_finite_advantages(self, estimator_name: str, estimator_settings: dict) -> None:
        for groups in ({"a": [1.0] * 4, "b": [0.0] * 4, "c": [0.5] * 4}, {"a": [1.0] * 4, "b": [1.0] * 4}):
            rows, _ = self._advantages(estimator_name, estimator_settings, _trajectories(groups))
            if self.group_relative:
                # A group whose samples all scored the same teaches nothing.
                assert all(x == pytest.approx(0.0, abs=1e-6) for row in rows for x in row), rows

    def test_a_better_sample_never_gets_a_lower_advantage(self, estimator_name: str, estimator_settings: dict) -> None:
        batch = _trajectories(_GROUPS, equal_lengths=True)
        rows, _ = self._advantages(estimator_name, estimator_settings, batch, zero_values=True)
        trajs = batch.trajectories
        for g in _GROUPS:
            idx = [i for i, t in enumerate(trajs) if t.group_id == g]
            mean = {i: sum(rows[i]) / trajs[i].n_generated for i in idx}
            ranked = sorted(idx, key=lambda i: trajs[i].reward)
            for lo, hi in zip(ranked, ranked[1:]):
                if trajs[hi].reward > trajs[lo].reward:
                    assert mean[hi] >= mean[lo] - 1e-6, (g, trajs[lo].reward, trajs[hi].reward, mean)
            best, worst = ranked[-1], ranked[0]
            if trajs[best].reward > trajs[worst].reward:
                assert mean[best] > mean[worst], (g, mean)

    def test_group_relativity_is_as_declared(self, estimator_name: str, estimator_settings: dict) -> None:
        base, _ = self._advantages(estimator_name, estimator_settings, _trajectories(_GROUPS))
        shifted, _ = self._advantages(
            estimator_name, estimator_settings, _trajectories({**_GROUPS, "c": [r + 3.0 for r in _GROUPS["c"]]})
        )
        other, _ = self._advantages(
            estimator_name, estimator_settings, _trajectories({**_GROUPS, "c": [1.0, 0.0, 0.0, 0.0]})
        )
        n_ab = len(_GROUPS["a"]) + len(_GROUPS["b"])

        def same(x: list[list[float]], y: list[list[float]]) -> bool:
            return all(a == pytest.approx(b, abs=1e-6) for rx, ry in zip(x, y) for a, b in zip(rx, ry))

        holds = same(base, shifted) and same(base[:n_ab], other[:n_ab])
        assert holds == self.group_relative, (
            "advantages do not depend only on the rewards relative to their own group; set group_relative = False"
            if self.group_relative
            else "advantages depend only on rewards relative to their own group; set group_relative = True"
        )

    def test_order_and_group_names_do_not_matter(self, estimator_name: str, estimator_settings: dict) -> None:
        import dataclasses

        from areal_kernel.api.io import TrajectoryBatch

        batch = _trajectories(_GROUPS)
        values = self._values(batch)
        base, _ = self._advantages(estimator_name, estimator_settings, batch, values=values)
        order = list(range(len(batch)))[::-1]
        moved_batch = TrajectoryBatch(
            [
                dataclasses.replace(batch.trajectories[i], group_id="renamed-" + batch.trajectories[i].group_id)
                for i in order
            ]
        )
        moved, _ = self._advantages(estimator_name, estimator_settings, moved_batch, values=[values[i] for i in order])
        for k, i in enumerate(order):
            assert moved[k] == pytest.approx(base[i], abs=1e-6), (k, i)

    def test_takes_every_keyword_the_kernel_passes(self, estimator_name: str, estimator_settings: dict) -> None:
        from areal_kernel.algo.estimators import to_token_rows
        from areal_kernel.config.sections import settings_kwargs, validate_settings

        batch = _trajectories(_GROUPS)
        # KL folded into the rewards (algorithm.kl_in: reward) arrives as token_rewards.
        rows, _ = self._advantages(estimator_name, estimator_settings, batch, kl_in="reward", kl_coef=0.1)
        assert all(_finite(x) for row in rows for x in row)
        spec = _spec("advantage_estimator", estimator_name)
        fn = spec.load()
        settings = settings_kwargs(
            validate_settings(
                f"algorithm.{estimator_name}", spec.kind, spec.name, estimator_settings or None, spec=spec
            )
        )
        trajs = batch.trajectories
        rewards = [t.reward for t in trajs]
        gids = [t.group_id for t in trajs]
        masks = [list(t.loss_mask) for t in trajs]
        values = self._values(batch) if "needs_values" in spec.capabilities else None
        before = json.dumps([rewards, gids, masks, values])
        for norm in (None, "group", "batch", "none"):  # algorithm.adv_norm, None = the estimator's default
            out = fn(rewards, gids, loss_masks=masks, token_rewards=None, values=values, gamma=1.0, lam=1.0,
                     norm=norm, std_normalize=True, eps=1e-6, **settings, **{_EXTRA_KEYWORD: True})  # fmt: skip
            to_token_rows(out, masks, estimator_name)  # the kernel's shape and finiteness check
        assert json.dumps([rewards, gids, masks, values]) == before, "the estimator changed its inputs"

    def test_its_settings_take_effect(
        self, estimator_name: str, estimator_settings: dict, estimator_settings_alt: dict | None
    ) -> None:
        batch = _trajectories(_GROUPS)
        base, _ = self._advantages(estimator_name, estimator_settings, batch)
        if estimator_settings_alt is None:
            # Without alternative settings: the same settings give the same advantages.
            assert self._advantages(estimator_name, estimator_settings, batch)[0] == base
            return
        alt, _ = self._advantages(estimator_name, estimator_settings_alt, batch)
        assert alt != base, f"algorithm.{estimator_name}: {estimator_settings_alt} changed nothing"

    def test_unknown_setting_is_refused(self, estimator_name: str) -> None:
        _check_unknown_setting_is_refused("advantage_estimator", estimator_name, f"algorithm.{estimator_name}")


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def _loss_batch() -> Any:
    """Two groups of two samples sharing a prompt, of different lengths."""
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rows = [
        ([1, 9, 4, 4], [17, 23, 5]),
        ([1, 9, 4, 4], [31, 8, 8, 12, 40]),
        ([1, 3, 3], [19, 2]),
        ([1, 3, 3], [77, 6, 6, 6]),
    ]
    trajs = []
    for i, (prompt, gen) in enumerate(rows):
        n, m = len(prompt), len(gen)
        trajs.append(
            Trajectory(
                prompt + gen,
                [0] * n + [1] * m,
                [0.0] * (n + m),
                [-1] * n + [0] * m,
                reward=float(i % 2),
                group_id=f"g{i // 2}",
            )
        )
    return TrajectoryBatch(trajs)


class LossContract:
    """Fixture: ``loss_name`` (your ``algorithm.loss``). Optional:
    ``loss_settings`` (your ``algorithm.<name>`` section, default ``{}``),
    ``loss_settings_alt`` (other settings that must change the loss;
    default ``None``: not checked) and ``loss_knobs`` (shared ``algorithm``
    knobs such as ``{"loss_agg": "seq-mean-token-mean"}``, default ``{}``;
    parametrize it to cover several). ``loss_model_dir`` (default: the
    session's tiny Llama) is what the kernel's torch engine trains."""

    @pytest.fixture
    def loss_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def loss_settings_alt(self) -> dict[str, Any] | None:
        return None

    @pytest.fixture
    def loss_knobs(self) -> dict[str, Any]:
        return {}

    @pytest.fixture(scope="class")
    @classmethod
    def loss_model_dir(cls, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def loss_engine(cls, loss_model_dir: str) -> Any:
        engine = _torch_engine(loss_model_dir, total_steps=8)
        yield engine
        engine.destroy()

    @pytest.fixture(scope="class")
    @classmethod
    def loss_step(cls, loss_engine: Any) -> dict[str, Any]:
        """One micro-batch's tensors exactly as the engine hands them to a
        loss: off-policy behaviour logprobs, recomputed proximal ones, mixed-sign advantages."""
        from areal_kernel.algo.losses import ppo_actor_loss
        from areal_kernel.algo.rl import bind_loss

        batch = _loss_batch()
        rng = random.Random(1)
        current = loss_engine.compute_logprobs(batch)
        for t, row in zip(batch.trajectories, current):
            t.logprobs = [lp + rng.uniform(-0.3, 0.3) if m else 0.0 for lp, m in zip(row, t.loss_mask)]
        extra = {
            "advantages": [[(1.0 if t.reward > 0 else -1.0) * (0.5 + rng.random()) * m for m in t.loss_mask]
                           for t in batch.trajectories],
            "prox_logprobs": loss_engine.compute_logprobs(batch, only_loss_tokens=True),
        }  # fmt: skip
        seen: list[tuple[Any, Any, dict[str, Any]]] = []
        ppo = bind_loss(ppo_actor_loss, {})

        def capture(logprobs: Any, entropy: Any, data: dict[str, Any]) -> Any:
            seen.append((logprobs.detach().clone(), entropy.detach().clone(), {k: v.clone() for k, v in data.items()}))
            return ppo(logprobs, entropy, data)

        loss_engine.train_batch(batch, capture, extra)
        assert len(seen) == 1, "expected the whole batch in one micro-batch"
        lp, ent, data = seen[0]
        return {"batch": batch, "extra": extra, "logprobs": lp, "entropy": ent, "data": data}

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _loss_fn(name: str, settings: dict | None, knobs: dict, extra_options: dict | None = None) -> Any:
        """The ``loss_fn`` the trainer hands ``train_batch``: registry target,
        shared knobs and validated settings as keywords."""
        from areal_kernel.algo.rl import RLConfig, bind_loss, loss_options

        cfg = RLConfig(loss=name, loss_settings=settings or None, **knobs)
        return bind_loss(_spec("loss", name).load(), {**loss_options(cfg), **(extra_options or {})})

    @staticmethod
    def _run(loss_fn: Any, logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[float, Any, dict[str, float]]:
        import torch

        lp = logprobs.clone().requires_grad_(True)
        loss, stats = loss_fn(lp, entropy, data)
        assert torch.is_tensor(loss) and loss.dim() == 0, f"the loss must be a 0-d tensor, got {loss!r}"
        assert loss.requires_grad, "the loss carries no gradient to the logprobs"
        loss.backward()
        assert isinstance(stats, dict), f"stats must be a dict, got {type(stats).__name__}"
        out = {}
        for k, v in stats.items():
            out[k] = float(v.detach()) if torch.is_tensor(v) else float(v)
        return float(loss.detach()), lp.grad.detach().clone(), out

    @staticmethod
    def _select(data: dict[str, Any], idx: Any, n: int) -> dict[str, Any]:
        # Per-token tensors are cut; the 0-d batch totals stay (what a micro-batch gets).
        return {k: (v[idx] if v.dim() == 1 and v.shape[0] == n else v) for k, v in data.items()}

    # -- tests ----------------------------------------------------------------
    def test_trains_in_the_kernel_engine(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_engine: Any, loss_step: dict
    ) -> None:
        batch = loss_step["batch"]
        # Proximal logprobs recomputed with the current weights, as the trainer does before a step.
        extra = dict(loss_step["extra"], prox_logprobs=loss_engine.compute_logprobs(batch, only_loss_tokens=True))
        stats = loss_engine.train_batch(batch, self._loss_fn(loss_name, loss_settings, loss_knobs), extra)
        assert stats["skipped"] == 0.0 and _finite(stats["loss"]), stats
        assert _finite(stats["grad_norm"]) and stats["grad_norm"] > 0, stats

    def test_micro_batch_shares_sum_to_the_batch_loss(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """The engine back-propagates each micro-batch's share and sums stats
        (max/min for ``_max``/``_min`` keys): any split must give the whole batch's loss and gradient."""
        import torch

        from areal_kernel.engine.microbatch import merge_stats

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], loss_step["data"]
        n = lp.shape[0]
        whole, grad, stats = self._run(fn, lp, ent, data)
        seq_ids = data["seq_ids"]
        for split in ([[0, 1], [2, 3]], [[0], [1, 2], [3]], [[3], [0, 1, 2]]):
            total = 0.0
            merged: dict[str, float] = {}
            g = torch.zeros_like(grad)
            for part in split:
                idx = torch.nonzero(torch.isin(seq_ids, torch.tensor(part))).flatten()
                share, g_part, s_part = self._run(fn, lp[idx], ent[idx], self._select(data, idx, n))
                total += share
                g[idx] = g_part
                merge_stats(merged, s_part)  # the engine's own rule for folding micro-batch stats
            assert total == pytest.approx(whole, rel=1e-5, abs=1e-6), (split, total, whole)
            assert torch.allclose(g, grad, rtol=1e-5, atol=1e-7), split
            for k, v in stats.items():
                assert merged[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (split, k)

    def test_tokens_off_the_loss_mask_change_nothing(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """Three more prompt tokens per sequence, with arbitrary logprobs: same
        loss, same gradient on the loss tokens, none on the new ones."""
        import torch

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], loss_step["data"]
        n = lp.shape[0]
        whole, grad, _ = self._run(fn, lp, ent, data)
        starts = torch.nonzero(data["position_ids"] == 0).flatten().tolist()
        src: list[int] = []
        added: list[bool] = []
        for i in range(n):
            src.append(i)
            added.append(False)
            if i in starts:  # copies of the sequence's first (prompt) token
                src += [i] * 3
                added += [True] * 3
        src_t, added_t = torch.tensor(src), torch.tensor(added)
        assert not bool((data["loss_mask"][src_t][added_t] > 0).any())
        g = torch.Generator().manual_seed(3)
        padded_lp = torch.where(added_t, -5 * torch.rand(len(src), generator=g), lp[src_t])
        padded_ent = torch.where(added_t, 3 * torch.rand(len(src), generator=g), ent[src_t])
        loss, g_pad, _ = self._run(fn, padded_lp, padded_ent, self._select(data, src_t, n))
        assert loss == pytest.approx(whole, rel=1e-5, abs=1e-6)
        assert torch.allclose(g_pad[~added_t], grad, rtol=1e-5, atol=1e-7)
        assert bool((g_pad[added_t] == 0).all()), "a token off the loss mask got a gradient"

    def test_gradient_follows_the_advantage(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """On-policy (behaviour = proximal = current logprobs), descending the
        loss raises the logprob of tokens with a positive advantage and lowers the others'."""
        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], dict(loss_step["data"])
        mask = data["loss_mask"] > 0
        data["old_logprobs"] = lp * mask
        if "prox_logprobs" in data:
            data["prox_logprobs"] = lp * mask
        _, grad, _ = self._run(fn, lp, ent, data)
        adv = data["advantages"]
        push = grad * adv
        assert bool((push[mask & (adv != 0)] <= 1e-9).all()), "a loss token is pushed against its advantage"
        assert float(push[mask].sum()) < 0, "the gradient does not follow the advantages"

    def test_extreme_inputs_stay_finite(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        import torch

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], dict(loss_step["data"])
        mask = data["loss_mask"] > 0
        sign = torch.where(torch.arange(lp.shape[0]) % 2 == 0, 1.0, -1.0)
        # Very stale samples (log-ratios of +-20) with large advantages.
        data["old_logprobs"] = torch.where(mask, lp + 20 * sign, torch.zeros_like(lp))
        if "prox_logprobs" in data:
            data["prox_logprobs"] = torch.where(mask, lp - 20 * sign, torch.zeros_like(lp))
        data["advantages"] = data["advantages"] * 1000
        loss, grad, stats = self._run(fn, lp, ent, data)
        assert _finite(loss) and bool(torch.isfinite(grad).all()), loss
        assert all(_finite(v) for v in stats.values()), stats

    def test_takes_every_keyword_the_kernel_passes(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        fn = self._loss_fn(loss_name, loss_settings, loss_knobs, {_EXTRA_KEYWORD: True})
        loss, _, _ = self._run(fn, loss_step["logprobs"], loss_step["entropy"], loss_step["data"])
        assert _finite(loss)

    def test_its_settings_take_effect(
        self, loss_name: str, loss_settings: dict, loss_settings_alt: dict | None, loss_knobs: dict, loss_step: dict
    ) -> None:
        args = (loss_step["logprobs"], loss_step["entropy"], loss_step["data"])
        base = self._run(self._loss_fn(loss_name, loss_settings, loss_knobs), *args)[0]
        if loss_settings_alt is None:
            assert self._run(self._loss_fn(loss_name, loss_settings, loss_knobs), *args)[0] == base
            return
        alt = self._run(self._loss_fn(loss_name, loss_settings_alt, loss_knobs), *args)[0]
        assert alt != pytest.approx(base), f"algorithm.{loss_name}: {loss_settings_alt} changed nothing"

    def test_unknown_setting_is_refused(self, loss_name: str) -> None:
        _check_unknown_setting_is_refused("loss", loss_name, f"algorithm.{loss_name}")


# ---------------------------------------------------------------------------
# Workflows
# ---------------------------------------------------------------------------


class _RecordingEngine:
    """The real inference engine, with every request and response kept."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list[tuple[Any, Any]] = []

    async def agenerate(self, req: Any) -> Any:
        resp = await self._engine.agenerate(req)
        self.calls.append((req, resp))
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _torch_engine(model_dir: str, total_steps: int) -> Any:
    """The kernel's torch train engine on ``model_dir`` (lr 1e-3, seed 0), initialized."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(model_dir, total_steps)
    return engine


def _embedded_engine(model_dir: str, run_dir: str) -> tuple[Any, Any]:
    """The kernel's embedded server (one, fp32) on ``model_dir`` and its client."""
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=run_dir)
    infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
    return launcher, RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())


async def _closing(engine: Any, coro: Any) -> Any:
    """Await ``coro``, then release the engine's sessions of this event loop."""
    try:
        return await coro
    finally:
        close = getattr(engine, "aclose", None)
        if close is not None:
            await close(current_loop_only=True)


def _responses_text(tokenizer: Any, trajectory: Any) -> list[str]:
    """Each run of loss tokens of ``trajectory`` (one engine response) decoded
    with special tokens skipped."""
    out, run = [], []
    for tok, m in zip([*trajectory.input_ids, None], [*trajectory.loss_mask, 0]):
        if m:
            run.append(tok)
        elif run:
            out.append(tokenizer.decode(run, skip_special_tokens=True))
            run = []
    return out


class WorkflowContract:
    """Fixture: ``workflow_name`` (your ``workflow.type``). Optional:
    ``workflow_settings`` (your ``workflow.<name>`` section, default
    ``{}``), ``workflow_record`` (a record with your ``required_fields``,
    default a ``prompt``/``answer`` question), ``workflow_model_dir``
    (class-scoped; default the session's tiny chat Llama) and
    ``workflow_engine`` (class-scoped; default the kernel's embedded server
    on that model). The reward is ``areal_kernel.testing.probe_reward``, run
    in the kernel's reward workers. Override ``expected_completion`` if your
    reward sees something else than the decoded generated tokens (or one
    response of them).

    A trajectory's reward must come from reward calls on its own generated
    text, combined as the workflow likes (``multi_turn`` discounts a retry),
    within ``[min(0, scores), max(0, scores)]`` of those calls."""

    N_SAMPLES = 3
    MAX_NEW_TOKENS = 6

    @pytest.fixture
    def workflow_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def workflow_record(self) -> dict[str, Any]:
        return {"id": "contract-q1", "prompt": "What is 2 + 3?", "answer": "5"}

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_model_dir(cls, areal_tiny_chat_model_dir: str) -> str:
        return areal_tiny_chat_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_engine(cls, workflow_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        launcher, engine = _embedded_engine(workflow_model_dir, str(tmp_path_factory.mktemp("workflow-server")))
        yield engine
        engine.destroy()
        launcher.stop()

    def expected_completion(self, tokenizer: Any, trajectory: Any) -> str:
        """What the reward must receive for ``trajectory``: its generated
        tokens decoded with special tokens skipped (docs: Rewards)."""
        return tokenizer.decode(
            [t for t, m in zip(trajectory.input_ids, trajectory.loss_mask) if m], skip_special_tokens=True
        )

    def _build(
        self, name: str, settings: dict, model_dir: str, log_path: str, fail: bool = False
    ) -> tuple[Any, Any, Any]:
        """The workflow as ``Rollout.start`` builds it, rewarded by the probe."""
        from areal_kernel.reward.pool import RewardPool
        from areal_kernel.testing.probe_reward import PROBE_REWARD_TARGET
        from areal_kernel.trainer.components import generation_config, load_tokenizer

        cfg = _config({
            "workflow": _section(name, settings, type=name),
            "rollout": {"gconfig": {"n_samples": self.N_SAMPLES, "max_new_tokens": self.MAX_NEW_TOKENS}},
        })  # fmt: skip
        tokenizer = load_tokenizer(model_dir)
        pool = RewardPool(n_workers=1, timeout_s=60, preload=(),
                          settings={PROBE_REWARD_TARGET: {"log_path": log_path, "fail": fail}})  # fmt: skip
        from areal_kernel.api.reward import Reward
        from areal_kernel.api.workflow import WorkflowContext
        from areal_kernel.testing import probe_reward

        reward = Reward(
            name="probe",
            target=PROBE_REWARD_TARGET,
            plugin="areal_kernel.testing",
            fn=probe_reward.probe_reward,
            settings={"log_path": log_path, "fail": fail},
        )
        workflow = _build("workflow", name, WorkflowContext(
            name=name, tokenizer=tokenizer, gconfig=generation_config(cfg), reward=reward, reward_pool=pool,
            settings=cfg.workflow.plugin_config, config=cfg,
        ))  # fmt: skip
        return workflow, pool, tokenizer

    def _episode(self, workflow: Any, engine: Any, record: dict) -> tuple[Any, _RecordingEngine]:
        from areal_kernel.api.io import TrajectoryGroup

        rec = _RecordingEngine(engine)
        group = asyncio.run(_closing(engine, workflow.arun_episode(rec, dict(record))))
        assert group is not None, "the workflow rejected the contract record; give a workflow_record it accepts"
        assert isinstance(group, TrajectoryGroup), f"arun_episode returned {type(group).__name__}"
        assert group.trajectories, "the group holds no trajectory"
        return group, rec

    def test_trains_on_exactly_what_the_engine_generated(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, str(tmp_path / "calls.jsonl"))
        try:
            group, rec = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        # Advantages are normalised per group id: every sample carries the group's.
        assert group.group_id and {t.group_id for t in group.trajectories} == {group.group_id}
        for k, t in enumerate(group.trajectories):
            assert set(t.loss_mask) <= {0, 1} and t.loss_mask[0] == 0, f"trajectory {k}: loss_mask {t.loss_mask}"
            assert sum(t.loss_mask) >= 1, f"trajectory {k} has no loss token"
            assert _finite(t.reward), t.reward
            for i, m in enumerate(t.loss_mask):
                if not m:
                    assert t.logprobs[i] == 0.0 and t.versions[i] == -1, f"trajectory {k} token {i} off the mask"
            # Each run of loss tokens is one response, generated from exactly the tokens before it.
            i = 0
            while i < len(t.loss_mask):
                if not t.loss_mask[i]:
                    i += 1
                    continue
                j = i
                while j < len(t.loss_mask) and t.loss_mask[j]:
                    j += 1
                match = [
                    r
                    for q, r in rec.calls
                    if list(q.input_ids) == t.input_ids[:i] and list(r.output_ids) == t.input_ids[i:j]
                ]
                assert match, (
                    f"trajectory {k}: loss tokens {i}:{j} are no response of the engine to the tokens before them"
                )
                # Several calls can share their ids (samples of one prompt that
                # said the same thing) yet differ in the last bits of their
                # logprobs (computed in different batches): one must agree exactly.
                assert any(t.logprobs[i:j] == list(r.output_logprobs) for r in match), (
                    f"trajectory {k}: logprobs {t.logprobs[i:j]} are none of the engine's "
                    f"{[list(r.output_logprobs) for r in match]}"
                )
                assert any(t.versions[i:j] == list(r.output_versions) for r in match), (
                    f"trajectory {k}: versions differ from the engine's"
                )
                i = j

    def test_rewards_are_called_as_documented(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        from areal_kernel.testing.probe_reward import read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, tok = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path)
        try:
            group, _ = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        calls = read_probe_calls(log_path)
        assert calls, "the reward was never called"
        assert all(c["answer"] == str(workflow_record["answer"]) for c in calls), calls
        for k, t in enumerate(group.trajectories):
            # The rule (docs: Workflows): a trajectory's reward comes from the
            # reward calls made on its own generated text (all of it, or one
            # response of it), combined as the workflow likes (a discounted
            # retry is fine) but never outside [min(0, scores), max(0, scores)].
            texts = {self.expected_completion(tok, t)} | set(_responses_text(tok, t))
            scores = [c["score"] for c in calls if c["completion"] in texts]
            assert scores, f"trajectory {k}: no reward call on its generated text {sorted(texts)}; calls {calls}"
            assert min(0.0, *scores) <= t.reward <= max(0.0, *scores), (
                f"trajectory {k}: reward {t.reward} is outside the scores of its reward calls {scores} (and 0)"
            )
        assert (getattr(wf, "reward_calls", None), getattr(wf, "reward_failures", None)) == (len(calls), 0)

    def test_failed_reward_calls_are_counted(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """The trainer stops a run when too many reward calls fail: it reads
        ``reward_calls``, ``reward_failures`` and ``last_reward_error``."""
        from areal_kernel.testing.probe_reward import PROBE_FAILURE, read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path, fail=True)
        try:
            group, _ = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        n = len(read_probe_calls(log_path))
        assert n >= 1
        assert (wf.reward_calls, wf.reward_failures) == (n, n)
        assert PROBE_FAILURE in (wf.last_reward_error or ""), wf.last_reward_error
        assert all(t.reward == 0.0 for t in group.trajectories), "a failed reward call must score 0"

    def test_same_sample_seed_same_samples(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """A resumed run regenerates the samples the killed run would have:
        records carry ``_sample_seed`` and the workflow seeds sampling from it."""
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, str(tmp_path / "calls.jsonl"))
        record = {**workflow_record, "_sample_seed": 1234, "_sample_uid": "e0-0"}
        try:
            a, _ = self._episode(wf, workflow_engine, record)
            b, _ = self._episode(wf, workflow_engine, record)
        finally:
            pool.close()
        assert [t.input_ids for t in a.trajectories] == [t.input_ids for t in b.trajectories]

    def test_evaluates_one_record_greedily(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """What the held-out evaluation calls: ``aevaluate(engine, record, max_new_tokens) -> (reward, text)``."""
        from areal_kernel.testing.probe_reward import probe_score, read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path)
        try:
            score, text = asyncio.run(
                _closing(workflow_engine, wf.aevaluate(workflow_engine, dict(workflow_record), 4))
            )
            again = asyncio.run(_closing(workflow_engine, wf.aevaluate(workflow_engine, dict(workflow_record), 4)))
        finally:
            pool.close()
        assert isinstance(text, str) and isinstance(score, float)
        assert score == probe_score(text) and again == (score, text), "greedy evaluation must be repeatable"
        assert [c["completion"] for c in read_probe_calls(log_path)] == [text, text]

    def test_required_fields_are_declared(self, workflow_name: str, workflow_record: dict) -> None:
        # The kernel checks every dataset record for these before any server starts.
        fields = getattr(_spec("workflow", workflow_name).load(), "required_fields", ("prompt",))
        assert isinstance(fields, tuple) and all(isinstance(f, str) and f for f in fields), fields
        assert all(f in workflow_record for f in fields), (fields, sorted(workflow_record))

    def test_unknown_setting_is_refused(self, workflow_name: str) -> None:
        _check_unknown_setting_is_refused("workflow", workflow_name, f"workflow.{workflow_name}")


# ---------------------------------------------------------------------------
# Weight transports
# ---------------------------------------------------------------------------


class WeightTransportContract:
    """Fixture: ``transport_name`` (a registered weight transport; class-scoped).
    Optional, all class-scoped: ``transport_model_dir`` (default the
    session's tiny Llama), ``transport_train_engine`` (default the kernel's
    torch engine on it) and ``transport_inference_engine`` (default the
    kernel's embedded server on it, fp32). Override ``change_weights`` if
    your train engine's ``named_weights_for_transfer()`` are not live views."""

    PROMPT = [5, 6, 7, 8]
    NEW_TOKENS = 8
    LOGPROB_ATOL = 1e-3
    BUCKET_BYTES = 64 << 10  # several buckets for the tiny model

    @pytest.fixture(scope="class")
    @classmethod
    def transport_model_dir(cls, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def transport_train_engine(cls, transport_model_dir: str) -> Any:
        engine = _torch_engine(transport_model_dir, total_steps=4)
        yield engine
        engine.destroy()

    @pytest.fixture(scope="class")
    @classmethod
    def transport_inference_engine(cls, transport_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        launcher, engine = _embedded_engine(transport_model_dir, str(tmp_path_factory.mktemp("transport-server")))
        yield engine
        engine.destroy()
        launcher.stop()

    @pytest.fixture(scope="class")
    @classmethod
    def transport_runs_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        return str(tmp_path_factory.mktemp("transport-runs"))

    @pytest.fixture(scope="class")
    @classmethod
    def transport(
        cls, transport_name: str, transport_train_engine: Any, transport_inference_engine: Any, transport_runs_dir: str
    ) -> Any:
        """Built and set up as the trainer does, on the run directory ``<runs>/exp``."""
        run_dir = os.path.join(transport_runs_dir, "exp")
        os.makedirs(run_dir)
        from areal_kernel.api.weight_transport import WeightTransportContext

        t = _build("weight_transport", transport_name, WeightTransportContext(
            name=transport_name, train_engine=transport_train_engine,
            inference_engine=transport_inference_engine, run_dir=run_dir, bucket_bytes=cls.BUCKET_BYTES,
        ))  # fmt: skip
        t.setup()
        yield t
        close = getattr(t, "close", None)
        if close is not None:
            close()

    def change_weights(self, train_engine: Any) -> Callable[[], None]:
        """Change the train engine's weights in place; return what restores them."""
        import torch

        named = list(train_engine.named_weights_for_transfer())
        saved = [t.detach().clone() for _, t in named]
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for _, t in named:
                if t.is_floating_point():
                    t.add_(0.2 * torch.randn(t.shape, generator=g).to(t.dtype))

        def restore() -> None:
            with torch.no_grad():
                for (_, t), s in zip(named, saved):
                    t.copy_(s)

        return restore

    def _served(self, infer: Any) -> Any:
        from areal_kernel.api.io import GenerationConfig, ModelRequest

        req = ModelRequest(
            list(self.PROMPT), GenerationConfig(max_new_tokens=self.NEW_TOKENS, greedy=True, stop_token_ids=[])
        )
        return asyncio.run(_closing(infer, infer.agenerate(req)))

    def _assert_serves_the_trainer(self, train: Any, resp: Any) -> None:
        from areal_kernel.api.io import Trajectory, TrajectoryBatch

        ids = list(resp.input_ids) + list(resp.output_ids)
        n = len(resp.input_ids)
        traj = Trajectory(ids, [0] * n + [1] * resp.output_len, [0.0] * len(ids), [-1] * len(ids), reward=0.0)
        mine = train.compute_logprobs(TrajectoryBatch([traj]))[0][n:]
        diff = max(abs(a - b) for a, b in zip(mine, resp.output_logprobs))
        assert diff < self.LOGPROB_ATOL, f"served logprobs differ from the train engine's by {diff}"

    def test_has_a_name(self, transport: Any) -> None:
        # Reported to areal_on_weight_update observers.
        assert isinstance(transport.name, str) and transport.name

    def test_updates_serve_the_trainer_weights_under_the_new_version(
        self, transport: Any, transport_train_engine: Any, transport_inference_engine: Any, transport_runs_dir: str
    ) -> None:
        train, infer = transport_train_engine, transport_inference_engine
        base = self._served(infer)
        self._assert_serves_the_trainer(train, base)
        v = infer.get_version()
        restore = self.change_weights(train)
        try:
            metrics = transport.update(v + 1)
            assert isinstance(metrics, dict) and all(isinstance(k, str) and _finite(x) for k, x in metrics.items()), (
                metrics
            )
            changed = self._served(infer)
            assert infer.get_version() == v + 1 and set(changed.output_versions) == {v + 1}
            assert changed.output_logprobs != base.output_logprobs, "the new weights changed nothing on the servers"
            self._assert_serves_the_trainer(train, changed)
        finally:
            restore()
        transport.update(v + 2)
        back = self._served(infer)
        assert infer.get_version() == v + 2 and set(back.output_versions) == {v + 2}
        assert back.output_ids == base.output_ids
        self._assert_serves_the_trainer(train, back)
        # Whatever the transport wrote lies in the run directory.
        assert os.listdir(transport_runs_dir) == ["exp"], os.listdir(transport_runs_dir)


# ---------------------------------------------------------------------------
# Schedulers
# ---------------------------------------------------------------------------

_RANK = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    out = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "AREAL_CONTRACT_MARK")
    report = {"env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "sid": os.getsid(0), "child": child.pid}
    print("rank", os.environ.get("RANK"), "started", flush=True)
    tmp = os.path.join(out, "rank-%s.json.tmp" % os.environ["RANK"])
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.rename(tmp, tmp[:-4])
    time.sleep(600)
    """
)


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


class SchedulerContract:
    """Fixture: ``scheduler_name`` (your ``scheduler.type``; the class
    subclasses ``areal_kernel.api.scheduler.Scheduler``). Optional:
    ``scheduler_config`` (the rest of the config; default two actor ranks,
    ``actor.backend: torch:d2``, and one fp32 ``embedded`` server) and
    ``scheduler_model_dir`` (default the session's tiny Llama). Set the
    class attribute ``starts_train_ranks = False`` if yours cannot start
    train-engine ranks (the suite then checks its ``start_train_ranks``
    raises ``ArealError`` and starts nothing)."""

    starts_train_ranks: bool = True

    @pytest.fixture
    def scheduler_config(self) -> dict[str, Any]:
        return {"actor": {"backend": "torch:d2"}, "rollout": {"backend": "embedded", "embedded": {"dtype": "float32"}}}

    @pytest.fixture
    def scheduler_model_dir(self, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture
    def scheduler_cfg(self, scheduler_name: str, scheduler_config: dict) -> Any:
        # The scheduler's own section (scheduler.<name>) may come with the config.
        return _config(
            {**scheduler_config, "scheduler": {**scheduler_config.get("scheduler", {}), "type": scheduler_name}}
        )

    @pytest.fixture
    def scheduler(self, scheduler_name: str, scheduler_cfg: Any) -> Any:
        """Built as ``Rollout.start`` builds it (``Registry.build``)."""
        from areal_kernel.api.scheduler import SchedulerContext

        sched = _build("scheduler", scheduler_name, SchedulerContext(name=scheduler_name, config=scheduler_cfg))
        yield sched
        sched.stop()

    def test_reports_its_platform(self, scheduler: Any) -> None:
        from areal_kernel.platforms import Platform

        # The trainer asks it which platform picks the weight transport.
        assert isinstance(scheduler.platform, Platform)

    def test_is_built_on_the_kernel_contract(self, scheduler: Any) -> None:
        from areal_kernel.api.scheduler import Scheduler

        assert isinstance(scheduler, Scheduler), "subclass areal_kernel.api.scheduler.Scheduler"

    def test_plan_places_every_process_before_anything_starts(self, scheduler: Any, scheduler_cfg: Any) -> None:
        from areal_kernel.api.scheduler import Placement, SchedulePlan

        plan = scheduler.plan()
        assert isinstance(plan, SchedulePlan) and plan.platform == scheduler.platform.name
        want = {"actor": scheduler_cfg.actor.allocation.world_size, "rollout": scheduler_cfg.rollout.allocation.d}
        for role, n in want.items():
            ps = plan.roles[role]
            assert [p.index for p in ps] == list(range(n)), (role, ps)
            for p in ps:
                assert isinstance(p, Placement) and p.role == role and p.node and p.host, p
                if scheduler.platform.exclusive_devices:
                    assert p.devices, f"{p}: no devices on a platform with exclusive devices"
        assert plan.nodes() and json.dumps(plan.to_dict())
        assert scheduler.health() == [], "plan() must not start anything"

    def test_train_ranks_run_in_their_own_sessions_and_stop(
        self, scheduler: Any, scheduler_cfg: Any, tmp_path: Any
    ) -> None:
        from areal_kernel.testing.procs import is_alive
        from areal_kernel.testing.waits import wait_until

        if not self.starts_train_ranks:
            from areal_kernel.errors import ArealError

            # One clear error, not a half-started world.
            with pytest.raises(ArealError):
                scheduler.start_train_ranks([sys.executable, "-c", "pass"], str(tmp_path / "logs"), {})
            assert scheduler.health() == []
            return
        world = scheduler_cfg.actor.allocation.world_size
        out, logs = tmp_path / "out", tmp_path / "logs"
        out.mkdir()
        procs = scheduler.start_train_ranks(
            [sys.executable, "-c", _RANK, str(out)], str(logs), {"AREAL_CONTRACT_MARK": "m"}
        )
        assert len(procs) == world
        wait_until(lambda: len(list(out.glob("rank-*.json"))) == world, timeout_s=60, what="every rank to report")
        reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
        master = {(x["env"]["MASTER_ADDR"], x["env"]["MASTER_PORT"]) for x in reports}
        assert len(master) == 1 and None not in next(iter(master)), master
        # The rendezvous is on rank 0's node.
        assert next(iter(master))[0] == scheduler.placements("actor")[0].host, master
        running = [s for s in scheduler.health() if s.placement.role == "actor"]
        assert sorted(s.placement.index for s in running) == list(range(world)) and all(s.alive for s in running)
        assert len(scheduler.logs()["actor"]) == world, scheduler.logs()
        nodes = [p.node for p in scheduler.placements("actor")]
        for r, x in enumerate(reports):
            # LOCAL_RANK / LOCAL_WORLD_SIZE count the ranks on the same node.
            local = (str(nodes[:r].count(nodes[r])), str(nodes.count(nodes[r])))
            assert (x["env"]["LOCAL_RANK"], x["env"]["LOCAL_WORLD_SIZE"]) == local, (x, nodes)
            assert x["env"]["RANK"] == str(r) and x["env"]["WORLD_SIZE"] == str(world), x
            assert x["env"]["OMP_NUM_THREADS"] == "1" and x["env"]["AREAL_CONTRACT_MARK"] == "m", x
            assert x["sid"] == x["pid"], "each rank must lead its own session (stop kills the whole group)"
            assert x["pid"] in {p.pid for p in procs}
        wait_until(lambda: all("started" in (logs / f"rank-{r}.log").read_text() for r in range(world)),
                   timeout_s=30, what="the ranks' output in <log_dir>/rank-<r>.log")  # fmt: skip
        scheduler.stop()
        assert scheduler.health() == [], "stop() must forget what it ended"
        pids = [x["pid"] for x in reports] + [x["child"] for x in reports]
        wait_until(lambda: not any(is_alive(p) for p in pids), timeout_s=30, what="the ranks and their children to end")

    def test_starts_inference_servers_and_stops_them(
        self, scheduler: Any, scheduler_cfg: Any, scheduler_model_dir: str, tmp_path: Any
    ) -> None:
        from areal_kernel.api.io import GenerationConfig, ModelRequest
        from areal_kernel.testing.waits import wait_until

        cfg = scheduler_cfg
        from areal_kernel.api.inference_engine import InferenceBackendContext

        backend = _build("inference_engine", cfg.rollout.allocation.backend, InferenceBackendContext.for_config(cfg))
        addresses = scheduler.start_inference(backend, scheduler_model_dir, str(tmp_path / "run"))
        assert len(addresses) == cfg.rollout.allocation.d, addresses
        placed = scheduler.placements("rollout")
        servers = [s for s in scheduler.health() if s.placement.role == "rollout"]
        assert [s.placement for s in servers] == placed[: len(addresses)] and all(s.alive for s in servers), servers
        client = backend.make_client(addresses)
        try:
            resp = asyncio.run(
                _closing(client, client.agenerate(ModelRequest([5, 6], GenerationConfig(max_new_tokens=2))))
            )
            assert resp.output_len >= 1
        finally:
            client.destroy()
        scheduler.stop()
        wait_until(lambda: not any(_accepts(a) for a in addresses), timeout_s=30, what="the servers to stop")

    def test_stop_twice(self, scheduler: Any) -> None:
        scheduler.stop()
        scheduler.stop()


# ---------------------------------------------------------------------------
# Tool-call parsers and tools
# ---------------------------------------------------------------------------

# Model output a parser must survive without raising (garbage, truncation, nesting).
_HOSTILE_OUTPUTS = [
    "",
    "plain answer: 42",
    "\x00\ufffd\U0001f600 \u202e",
    "{" * 200 + "}" * 3,
    "<tool_call>",
    "</tool_call>",
    '<tool_call>{"name": "x", "arguments": {"a": 1}',
    "<tool_call>null</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": 7}</tool_call>',
    '<tool_call>{"name": "x", "arguments": "{oops"}</tool_call>',
    "<think>unfinished reasoning",
    "</think></think><think>",
    '```json\n{"name": "x"}\n```',
]


class ToolParserContract:
    """Fixtures: ``tool_parser_name`` (the registered parser) and
    ``tool_parser_cases`` (a list of ``(text, calls)`` where ``calls`` is the
    list of ``(name, arguments_dict)`` the parser must find, in order).
    Optional: ``tool_parser_malformed`` (texts holding a malformed call that
    must yield an entry of ``errors``; default ``[]``)."""

    @pytest.fixture
    def tool_parser_malformed(self) -> list[str]:
        return []

    @staticmethod
    def _parser(name: str) -> Any:
        from areal_kernel.tools import ToolCallParser, build_tool_parser

        parser = build_tool_parser(name)
        assert isinstance(parser, ToolCallParser)
        return parser

    @staticmethod
    def _check_output(out: Any) -> None:
        from areal_kernel.tools import ParsedOutput, ToolCall

        assert isinstance(out, ParsedOutput), f"parse returned {type(out).__name__}, not ParsedOutput"
        assert isinstance(out.content, str) and (out.reasoning is None or isinstance(out.reasoning, str))
        assert isinstance(out.tool_calls, tuple) and isinstance(out.errors, tuple)
        assert all(isinstance(e, str) and e for e in out.errors), out.errors
        ids = [c.id for c in out.tool_calls]
        assert len(set(ids)) == len(ids), f"tool call ids repeat within one output: {ids}"
        for c in out.tool_calls:
            assert isinstance(c, ToolCall) and c.id and c.name, c
            assert isinstance(json.loads(c.arguments), dict), f"arguments of {c.name} are not a JSON object: {c}"

    def test_stop_strings_are_non_empty_strings(self, tool_parser_name: str) -> None:
        stops = self._parser(tool_parser_name).stop_strings
        assert isinstance(stops, tuple) and all(isinstance(s, str) and s for s in stops), stops

    def test_finds_the_calls(self, tool_parser_name: str, tool_parser_cases: list) -> None:
        parser = self._parser(tool_parser_name)
        assert any(calls for _, calls in tool_parser_cases), "give at least one case that holds a call"
        for text, calls in tool_parser_cases:
            out = parser.parse(text)
            self._check_output(out)
            got = [(c.name, json.loads(c.arguments)) for c in out.tool_calls]
            assert got == [(n, a) for n, a in calls], (text, got)
            assert not out.errors, (text, out.errors)

    def test_generation_stopped_at_a_stop_string_holds_the_call(
        self, tool_parser_name: str, tool_parser_cases: list
    ) -> None:
        """Generation ends right after the first stop string: the text up to
        there must already hold the first call."""
        parser = self._parser(tool_parser_name)
        for text, calls in tool_parser_cases:
            if not calls:
                continue
            ends = [text.find(s) + len(s) for s in parser.stop_strings if s in text]
            assert ends, f"no stop string of {parser.stop_strings} in a text holding a call: {text!r}"
            out = parser.parse(text[: min(ends)])
            self._check_output(out)
            assert out.tool_calls and (out.tool_calls[0].name, json.loads(out.tool_calls[0].arguments)) == (
                calls[0][0],
                calls[0][1],
            ), (text[: min(ends)], out)

    def test_malformed_calls_are_errors_not_exceptions(
        self, tool_parser_name: str, tool_parser_malformed: list[str]
    ) -> None:
        parser = self._parser(tool_parser_name)
        for text in _HOSTILE_OUTPUTS + list(tool_parser_malformed):
            self._check_output(parser.parse(text))
        for text in tool_parser_malformed:
            assert parser.parse(text).errors, f"a malformed call gave no error: {text!r}"


class ToolContract:
    """Fixtures: ``tool_name`` (the registered tool) and ``tool_cases`` (a
    list of ``(arguments, expected)``: the call's text must contain
    ``expected``). Optional: ``tool_settings`` (its settings, default
    ``{}``) and ``tool_bad_arguments`` (argument objects the tool must
    refuse: the call raises, which the kernel feeds back as an error;
    default ``[]``)."""

    @pytest.fixture
    def tool_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def tool_bad_arguments(self) -> list[dict[str, Any]]:
        return []

    @staticmethod
    def _box(name: str, settings: dict) -> Any:
        from areal_kernel.tools import ToolBox

        return ToolBox.build([name], {name: settings} if settings else None, timeout_s=60.0)

    def test_describes_itself_in_openai_format(self, tool_name: str, tool_settings: dict) -> None:
        box = self._box(tool_name, tool_settings)
        (schema,) = box.schemas()
        json.dumps(schema)  # what a chat template or an OpenAI client receives
        fn = schema["function"]
        assert schema["type"] == "function" and fn["name"] == tool_name
        assert isinstance(fn["description"], str) and fn["description"].strip()
        params = fn["parameters"]
        assert params.get("type") == "object" and isinstance(params.get("properties"), dict), params
        assert set(params.get("required", [])) <= set(params["properties"]), params

    def test_answers_the_cases(self, tool_name: str, tool_settings: dict, tool_cases: list) -> None:
        from areal_kernel.tools import ToolCall

        box = self._box(tool_name, tool_settings)
        required = set(box.schemas()[0]["function"]["parameters"].get("required", []))
        calls = [ToolCall(f"call_{i}", tool_name, json.dumps(args)) for i, (args, _) in enumerate(tool_cases)]
        assert calls, "give at least one case"

        async def run_all() -> list[Any]:
            # Concurrently, as episodes of a run call tools at the same time.
            return await asyncio.gather(*(box.execute(c) for c in calls))

        for (args, expected), res in zip(tool_cases, asyncio.run(run_all())):
            assert required <= set(args), f"case {args} lacks required arguments {sorted(required - set(args))}"
            assert res.ok, f"{tool_name}({args}) failed: {res.content}"
            assert isinstance(res.content, str) and expected in res.content, (args, res.content)

    def test_bad_arguments_become_an_error_message(
        self, tool_name: str, tool_settings: dict, tool_bad_arguments: list
    ) -> None:
        from areal_kernel.tools import ToolCall

        box = self._box(tool_name, tool_settings)
        for args in [*tool_bad_arguments, None]:
            text = "{not json" if args is None else json.dumps(args)
            res = asyncio.run(box.execute(ToolCall("call_0", tool_name, text)))
            assert not res.ok and res.content.startswith("error:") and tool_name in res.content, (args, res)

    def test_unknown_setting_is_refused(self, tool_name: str) -> None:
        _check_unknown_setting_is_refused("tool", tool_name, f"tools.{tool_name}")
