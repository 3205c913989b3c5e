"""The built-in torch train engine passes the kernel's train-engine contract."""
import pytest

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.contracts import (
    JointPoliciesContract,
    TrainEngineContract,
    engine_maker,
    policies_engine_maker,
)

SETTINGS = {"lr": 1e-3, "max_tokens_per_mb": 8}


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def make_train_engine(contract_model_dir):
    return engine_maker(lambda: TorchTrainEngine(SETTINGS), contract_model_dir, 10)


@pytest.fixture
def train_engine(make_train_engine):
    e = make_train_engine()
    yield e
    e.destroy()


class TestTorchEngineContract(TrainEngineContract):
    pass


# Two adapters of different shapes and targets (as in test_multi_adapter.py).
POLICY_ADAPTERS = [
    {"name": "A", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
    {"name": "b.v2", "rank": 2, "alpha": 4, "target_modules": ["k_proj", "o_proj"]},
]


@pytest.fixture
def make_policies_engine(contract_model_dir):
    def new(split: bool) -> TorchTrainEngine:
        return TorchTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 8 if split else 64, "adapters": POLICY_ADAPTERS})

    with policies_engine_maker(new, contract_model_dir, 10) as make:
        yield make


class TestTorchEnginePolicies(JointPoliciesContract):
    pass


def test_the_joint_check_fails_an_engine_that_swaps_the_policies_batches(make_policies_engine, monkeypatch):
    """Negative control of ``JointPoliciesContract``: train_policies giving
    each policy the other's batch fails the equality check."""
    real = TorchTrainEngine.train_policies

    def swapped(self, jobs):
        a, b = list(jobs)
        return real(self, {a: jobs[b], b: jobs[a]})

    monkeypatch.setattr(TorchTrainEngine, "train_policies", swapped)
    with pytest.raises(AssertionError):
        TestTorchEnginePolicies().test_train_policies_equals_one_train_batch_per_policy(make_policies_engine)


def test_the_joint_check_fails_an_engine_that_never_shares_forwards(make_policies_engine, monkeypatch):
    """Negative control: a train_policies that always takes one policy at a
    time (the right numbers, ``joint`` 0) does not pass for the capability."""

    from areal_kernel.engine.together import one_at_a_time

    def never_shared(self, jobs):
        return one_at_a_time({n: self.policy(n) for n in jobs}, jobs)

    monkeypatch.setattr(TorchTrainEngine, "train_policies", never_shared)
    with pytest.raises(AssertionError, match="did not share its forwards"):
        TestTorchEnginePolicies().test_train_policies_equals_one_train_batch_per_policy(make_policies_engine)
