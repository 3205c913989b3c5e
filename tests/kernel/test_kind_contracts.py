"""The kernel's own defaults pass the contract suites third parties subclass
(areal_kernel.testing.contracts): every built-in dataset source, metric sink,
advantage estimator, loss, workflow, weight transport and scheduler, built
through the registry exactly as a run builds it."""
from __future__ import annotations

import glob
import json
import os

import pytest

from areal_kernel.testing import (
    AdvantageEstimatorContract,
    DatasetContract,
    LossContract,
    MetricSinkContract,
    SchedulerContract,
    WeightTransportContract,
    WorkflowContract,
)
from areal_kernel.testing.readback import console_rows, jsonl_rows, tensorboard_rows, wandb_offline_rows

# -- datasets ------------------------------------------------------------------------------


class TestArithmeticDataset(DatasetContract):
    @pytest.fixture
    def dataset_name(self):
        return "arithmetic"

    @pytest.fixture
    def dataset_settings(self):
        return {"n_train": 40, "n_eval": 8, "ops": ["+", "*"]}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _questions(n, start=0):
    return [{"question": f"What is {i} + {i + 1}?", "answer": i + i + 1} for i in range(start, start + n)]


class TestFileDataset(DatasetContract):
    """One jsonl file (numeric answers, a renamed field): the kernel holds out
    ``eval_fraction`` of it."""

    @pytest.fixture
    def dataset_name(self):
        return "file"

    @pytest.fixture
    def dataset_section(self, tmp_path):
        return {"path": _write_jsonl(tmp_path / "q.jsonl", _questions(30)), "field_map": {"question": "prompt"},
                "eval_fraction": 0.2}  # fmt: skip


class TestFileDatasetWithEvalSplit(DatasetContract):
    """A directory of split files, the held-out part named by ``eval_split``."""

    @pytest.fixture
    def dataset_name(self):
        return "file"

    @pytest.fixture
    def dataset_section(self, tmp_path):
        d = tmp_path / "qa"
        d.mkdir()
        _write_jsonl(d / "train.jsonl", _questions(20))
        _write_jsonl(d / "test.jsonl", _questions(5, start=100))
        return {"path": str(d), "field_map": {"question": "prompt"}, "eval_split": "test"}


# -- metric sinks --------------------------------------------------------------------------


class TestConsoleSink(MetricSinkContract):
    @pytest.fixture
    def sink_name(self):
        return "console"

    def read_back(self, run_dir, stdout):
        return console_rows(stdout)


class TestJsonlSink(MetricSinkContract):
    @pytest.fixture
    def sink_name(self):
        return "jsonl"

    def read_back(self, run_dir, stdout):
        return jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))


class TestTensorBoardSink(MetricSinkContract):
    @pytest.fixture
    def sink_name(self):
        return "tensorboard"

    def read_back(self, run_dir, stdout):
        return tensorboard_rows(os.path.join(run_dir, "tensorboard"))


class TestWandbOfflineSink(MetricSinkContract):
    """wandb in offline mode: a local run directory under the run directory,
    read back from wandb's own record format."""

    @pytest.fixture
    def sink_name(self):
        return "wandb"

    @pytest.fixture
    def sink_settings(self, monkeypatch):
        for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("WANDB_SILENT", "true")
        return {"mode": "offline", "project": "areal-contract", "tags": ["contract"]}

    def read_back(self, run_dir, stdout):
        assert glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")), os.listdir(run_dir)
        return wandb_offline_rows(run_dir)


# -- advantage estimators ------------------------------------------------------------------


class TestGRPOEstimator(AdvantageEstimatorContract):
    @pytest.fixture
    def estimator_name(self):
        return "grpo"


class TestDrGRPOEstimator(AdvantageEstimatorContract):
    @pytest.fixture
    def estimator_name(self):
        return "dr_grpo"


class TestRLOOEstimator(AdvantageEstimatorContract):
    @pytest.fixture
    def estimator_name(self):
        return "rloo"


class TestReinforcePPEstimator(AdvantageEstimatorContract):
    group_relative = False  # returns are normalised over the whole batch

    @pytest.fixture
    def estimator_name(self):
        return "reinforce_pp"


class TestReinforcePPBaselineEstimator(AdvantageEstimatorContract):
    group_relative = False  # group baseline, then batch normalisation

    @pytest.fixture
    def estimator_name(self):
        return "reinforce_pp_baseline"


class TestGAEEstimator(AdvantageEstimatorContract):
    group_relative = False  # a critic's values, batch normalisation

    @pytest.fixture
    def estimator_name(self):
        return "gae"


# -- losses --------------------------------------------------------------------------------


class TestPPOLoss(LossContract):
    """The decoupled PPO loss under its aggregation and ratio variants."""

    @pytest.fixture
    def loss_name(self):
        return "ppo"

    @pytest.fixture(
        params=[
            {},
            {"loss_agg": "seq-mean-token-mean"},
            {"loss_agg": "seq-mean-token-sum", "eps_clip_high": 0.28},
            {"ratio_level": "sequence"},
            {"behav_imp_weight_cap": 2.0, "behav_imp_weight_mode": "clamp", "dual_clip": 3.0},
        ],
        ids=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "gspo", "clamp-dual-clip"],
    )
    def loss_knobs(self, request):
        return request.param


# -- workflows -----------------------------------------------------------------------------


class TestRLVRWorkflow(WorkflowContract):
    @pytest.fixture
    def workflow_name(self):
        return "rlvr"

    @pytest.fixture
    def workflow_settings(self):
        return {"system_prompt": "Answer with a number.", "prompt_template": "Q: {prompt}"}


# -- weight transports ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_train_engine(areal_tiny_model_dir):
    """One torch engine for both transports (each restores the weights it changes)."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(areal_tiny_model_dir, 4)
    yield engine
    engine.destroy()


@pytest.fixture(scope="module")
def shared_server(areal_tiny_model_dir, tmp_path_factory):
    """One embedded server (fp32) for both transports: a server start costs seconds."""
    from areal_kernel.testing.servers import embedded_server

    with embedded_server(areal_tiny_model_dir, str(tmp_path_factory.mktemp("server"))) as engine:
        yield engine


class _SharedEngines:
    @pytest.fixture(scope="class")
    @classmethod
    def transport_train_engine(cls, shared_train_engine):
        return shared_train_engine

    @pytest.fixture(scope="class")
    @classmethod
    def transport_inference_engine(cls, shared_server):
        return shared_server


class TestDiskTransport(_SharedEngines, WeightTransportContract):
    @pytest.fixture(scope="class")
    @classmethod
    def transport_name(cls):
        return "disk"

    def test_writes_safetensors_under_the_run_dir_and_keeps_the_newest(self, transport, transport_runs_dir):
        from areal_kernel.weights.disk import list_safetensors_files

        transport.update(41)
        transport.update(42)
        root = os.path.join(transport_runs_dir, "exp", "weights")
        assert sorted(os.listdir(root)) == ["v42"]
        assert list_safetensors_files(os.path.join(root, "v42"))
        # close() takes what it wrote with it; setup() makes it usable again
        # for the class's other tests.
        transport.close()
        assert not os.path.exists(root)
        transport.setup()


class TestBroadcastTransport(_SharedEngines, WeightTransportContract):
    @pytest.fixture(scope="class")
    @classmethod
    def transport_name(cls):
        return "broadcast"


# -- schedulers ----------------------------------------------------------------------------


class TestLocalScheduler(SchedulerContract):
    @pytest.fixture
    def scheduler_name(self):
        return "local"

    def test_the_ranks_rendezvous_port_is_held_until_stop(self, scheduler):
        """Rank 0 binds ``MASTER_PORT`` seconds after it was chosen (after
        its imports); until ``stop`` no other process gets it."""
        from areal_kernel.utils.network import port_is_free

        host, port = scheduler.rendezvous("actor")
        assert not port_is_free(port, host), "the rendezvous port is not held"
        scheduler.stop()
        assert port_is_free(port, host), "stop() must let the rendezvous port go"
