"""``DatasetContract``: the suite for dataset sources (kind ``dataset``,
``areal_kernel.api.dataset``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _check_unknown_setting_is_refused, _config, _section, _spec


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
