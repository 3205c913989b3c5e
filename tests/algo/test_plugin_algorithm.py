"""A real third-party plugin (tests/algo/plugin_packages/areal-test-algo,
pip-installed into a private directory) registers an advantage estimator
and a policy loss; the config selects them by name and the RL step runs them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo import _fixed_batch

from areal_kernel.testing.packages import pip_install_private, use_private_site

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def algo_plugin_site(tmp_path_factory) -> Path:
    return pip_install_private(HERE / "plugin_packages" / "areal-test-algo", tmp_path_factory.mktemp("algo-plugin"))


@pytest.fixture
def with_algo_plugin(algo_plugin_site, monkeypatch, areal_env):
    return use_private_site(algo_plugin_site, monkeypatch, areal_env)


def test_plugin_estimator_and_loss_selected_by_config(with_algo_plugin, tiny_llama_dir):
    from areal_kernel.algo.rl import rl_train_step
    from areal_kernel.config.loader import load_config
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.run import _grpo_config

    reg = get_registry()
    assert reg.get("advantage_estimator", "sign", platform="").plugin == "testalgo"
    assert reg.get("loss", "vanilla_pg", platform="").plugin == "testalgo"

    cfg = load_config(
        str(REPO / "examples" / "grpo_arithmetic.yaml"),
        ["algorithm.advantage=sign", "algorithm.loss=vanilla_pg", "algorithm.advantage_kwargs={scale: 2.0}",
         "algorithm.loss_kwargs={pg_coef: 0.5}", "rollout.gconfig.temperature=1.0"],
    )  # fmt: skip
    rl_cfg = _grpo_config(cfg)
    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(tiny_llama_dir, 4)
    before = engine.model.lm_head.weight.detach().clone()
    # estimator and loss are not passed: rl_train_step resolves them through the registry
    stats = rl_train_step(_fixed_batch(), engine, rl_cfg)
    assert "vanilla_pg_loss" in stats and "clip_frac" not in stats  # the plugin's loss ran, not ppo
    assert stats["vanilla_pg_loss"] == pytest.approx(stats["loss"])
    # rewards [1, 0 | .5, .5]: signs [+1, -1 | 0, 0] * scale 2 -> mean |A| = (2 + 2) / 4
    assert stats["adv_abs"] == pytest.approx(1.0)
    assert not torch.equal(before, engine.model.lm_head.weight)


def test_unknown_names_are_config_errors_naming_the_field(areal_env):
    from areal_kernel.config.loader import load_config
    from areal_kernel.errors import ConfigError

    areal_env()
    with pytest.raises(ConfigError, match=r"algorithm\.advantage.*'sign'.*registered: dr_grpo, gae, grpo"):
        load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), ["algorithm.advantage=sign"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss.*'vanilla'.*registered: ppo"):
        load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), ["algorithm.loss=vanilla"])
