"""``TrainerContract`` on the kernel's trainers: the offline ones (``sft``,
``dpo``, ``ipo``, ``rm``) and the built-in ``grpo`` (one embedded server),
two steps each on a tiny random Llama with SmolLM2's tokenizer; and
its negative control: trainers broken in the ways the contract names,
registered the way a plugin registers them, are each rejected by the suite
with a message naming the trainer and its plugin."""

from __future__ import annotations

import os
from typing import Any

import pytest
from offline_paths import EXAMPLES, REPO
from pydantic import BaseModel

from areal_kernel.api.trainer import Trainer
from areal_kernel.config import read_yaml
from areal_kernel.plugins.registry import FactorySpec
from areal_kernel.testing.contracts import TrainerContract
from areal_kernel.trainer.common import make_sinks, write_run_config


def _example(name: str, model: str) -> dict[str, Any]:
    """An example config made short: two steps of two records, the jsonl sink only."""
    cfg = read_yaml(os.path.join(EXAMPLES, name))
    cfg["model"] = {**cfg["model"], "path": model}
    if cfg["dataset"].get("path"):  # relative to the repository, not to the test's directory
        cfg["dataset"] = {**cfg["dataset"], "path": os.path.join(REPO, cfg["dataset"]["path"])}
    cfg["trainer"] = {**cfg.get("trainer", {}), "max_steps": 2, "batch_size": 2, "eval_every": 0}
    cfg["logging"] = {"sinks": ["jsonl"]}
    return cfg


class TestSFTTrainer(TrainerContract):
    @pytest.fixture
    def trainer_name(self) -> str:
        return "sft"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model: str) -> dict[str, Any]:
        return _example("sft_chat.yaml", tiny_chat_model)


class TestDPOTrainer(TrainerContract):
    @pytest.fixture
    def trainer_name(self) -> str:
        return "dpo"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model: str) -> dict[str, Any]:
        return _example("dpo_arithmetic.yaml", tiny_chat_model)


class TestIPOTrainer(TrainerContract):
    """IPO reads DPO's section (``settings_section='dpo'``): the suite's
    misspelt ``algorithm.ipo`` key must still be refused, naming it."""

    @pytest.fixture
    def trainer_name(self) -> str:
        return "ipo"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model: str) -> dict[str, Any]:
        return _example("dpo_arithmetic.yaml", tiny_chat_model)


class TestGRPOTrainer(TrainerContract):
    """The kernel's own RL trainer, held to the contract a plugin's is: servers
    started in setup(), stopped by close() whatever setup got to."""

    @pytest.fixture
    def trainer_name(self) -> str:
        return "grpo"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model: str) -> dict[str, Any]:
        cfg = _example("grpo_arithmetic.yaml", tiny_chat_model)
        cfg["trainer"] = {**cfg["trainer"], "eval_size": 0}
        cfg["rollout"] = {**cfg["rollout"], "gconfig": {**cfg["rollout"]["gconfig"], "n_samples": 2,
                                                        "max_new_tokens": 4}}  # fmt: skip
        return cfg


class TestRewardModelTrainer(TrainerContract):
    @pytest.fixture
    def trainer_name(self) -> str:
        return "rm"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model: str) -> dict[str, Any]:
        return _example("rm_preferences.yaml", tiny_chat_model)


# -- the negative control: each trainer breaks one clause of the contract -------------


class _Minimal(Trainer):
    """Correct: one step, logged, then closed."""

    def setup(self) -> None:
        write_run_config(self.cfg, self.run_dir)
        self.sinks = make_sinks(self.cfg, self.run_dir, 1)

    def train(self) -> dict:
        for sink in self.sinks:
            sink.log(1, {"train/value": 1.0})
        return {"steps": 1}

    def close(self, status: str) -> None:
        for sink in getattr(self, "sinks", []):
            sink.close()


class EagerTrainer(_Minimal):
    """Writes into run_dir in its constructor."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        os.makedirs(self.run_dir, exist_ok=True)
        open(os.path.join(self.run_dir, "started"), "w").close()


class FragileCloseTrainer(_Minimal):
    """close() assumes setup() ran."""

    def close(self, status: str) -> None:
        for sink in self.sinks:
            sink.close()


class SilentTrainer(_Minimal):
    """Runs, but logs no step."""

    def train(self) -> dict:
        return {"steps": 1}


class LooseSettings(BaseModel):  # no extra="forbid": a misspelt key is silently dropped
    steps: int = 1


BROKEN = {
    "eager": ("EagerTrainer", None, "test_the_constructor_does_no_work", "constructor wrote into run_dir"),
    "fragile": ("FragileCloseTrainer", None, "test_close_without_setup", "close('failed') before setup() raised"),
    "silent": ("SilentTrainer", None, "test_a_run_writes_its_result_and_metrics_and_closes_once", "no step >= 1"),
    "loose": ("_Minimal", f"{__name__}:LooseSettings", "test_unknown_setting_is_refused", "was accepted"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_suite_rejects_a_broken_trainer_naming_its_plugin(name, areal_env, tmp_path):
    from areal_kernel.plugins import get_registry

    attr, config_model, test, fragment = BROKEN[name]
    areal_env()
    get_registry().add(
        FactorySpec(kind="trainer", name=name, target=f"{__name__}:{attr}", plugin="testbroken",
                    config_model=config_model)
    )  # fmt: skip
    suite = TrainerContract()
    config = {"logging": {"sinks": ["jsonl"]}}
    kwargs = {"trainer_name": name, "trainer_config": config, "tmp_path": tmp_path}
    if test != "test_unknown_setting_is_refused":
        kwargs["trainer_settings"] = {}
    with pytest.raises((AssertionError, pytest.fail.Exception)) as caught:
        getattr(suite, test)(**kwargs)
    message = str(caught.value)
    assert f"trainer '{name}' of plugin 'testbroken'" in message, message
    assert fragment in message, message


def test_the_suite_passes_the_minimal_trainer(areal_env, tmp_path):
    """The control of the control: the same calls pass on a trainer that keeps the contract."""
    from areal_kernel.plugins import get_registry

    areal_env()
    get_registry().add(FactorySpec(kind="trainer", name="minimal", target=f"{__name__}:_Minimal", plugin="testbroken"))
    suite = TrainerContract()
    config = {"logging": {"sinks": ["jsonl"]}}
    for i, test in enumerate(sorted({t for _, _, t, _ in BROKEN.values()})):
        kwargs: dict[str, Any] = {"trainer_name": "minimal", "trainer_config": config, "tmp_path": tmp_path / str(i)}
        if test != "test_unknown_setting_is_refused":
            kwargs["trainer_settings"] = {}
        getattr(suite, test)(**kwargs)
