"""A real third-party plugin (tests/algo/plugin_packages/areal-test-algo,
pip-installed into a private directory) registers an advantage estimator
and a policy loss; the config selects them by name and the RL step runs them."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_grpo import _fixed_batch


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def test_plugin_estimator_and_loss_selected_by_config(with_algo_plugin, tiny_llama_dir):
    from areal_kernel.algo.rl import rl_train_step
    from areal_kernel.config.loader import load_config
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.plugins import get_registry
    from areal_kernel.algo.rl import RLConfig

    reg = get_registry()
    assert reg.get("advantage_estimator", "sign", platform="").plugin == "testalgo"
    assert reg.get("loss", "vanilla_pg", platform="").plugin == "testalgo"

    cfg = load_config(
        str(REPO / "examples" / "grpo_arithmetic.yaml"),
        ["algorithm.advantage=sign", "algorithm.loss=vanilla_pg", "algorithm.sign={scale: 2.0}",
         "algorithm.vanilla_pg={pg_coef: 0.5}", "rollout.gconfig.temperature=1.0"],
        registry=get_registry(),
    )  # fmt: skip
    rl_cfg = RLConfig.from_config(cfg)
    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(tiny_llama_dir, 4)
    before = engine.model.lm_head.weight.detach().clone()
    # estimator and loss are not passed: rl_train_step resolves them through the registry;
    # both take knobs=, so nothing is deprecated on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        stats = rl_train_step(_fixed_batch(), engine, rl_cfg)
    assert "vanilla_pg_loss" in stats and "clip_frac" not in stats  # the plugin's loss ran, not ppo
    assert stats["vanilla_pg_loss"] == pytest.approx(stats["loss"])
    # rewards [1, 0 | .5, .5]: signs [+1, -1 | 0, 0] * scale 2 -> mean |A| = (2 + 2) / 4
    assert stats["adv_abs"] == pytest.approx(1.0)
    assert not torch.equal(before, engine.model.lm_head.weight)


def test_a_loss_written_for_the_keyword_convention_still_trains_and_is_told(with_algo_plugin, tiny_llama_dir):
    """``old_pg`` takes the shared knobs as keywords (no ``knobs`` parameter):
    the step still runs it, passing each knob's configured value, with a
    DeprecationWarning naming the loss and its plugin."""
    from areal_kernel.algo.rl import RLConfig, bind_loss, rl_train_step
    from areal_kernel.api.loss import LossKnobs
    from areal_kernel.config.loader import load_config
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.plugins import get_registry

    cfg = load_config(
        str(REPO / "examples" / "grpo_arithmetic.yaml"),
        ["algorithm.loss=old_pg", "algorithm.eps_clip=0.3", "rollout.gconfig.temperature=1.0"],
        registry=get_registry(),
    )
    rl_cfg = RLConfig.from_config(cfg)
    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(tiny_llama_dir, 4)
    told = r"loss 'old_pg' \(plugin 'testalgo'\).*deprecated.*knobs"
    with pytest.warns(DeprecationWarning, match=told):
        stats = rl_train_step(_fixed_batch(), engine, rl_cfg)
    assert "old_pg_loss" in stats and "clip_frac" not in stats
    with pytest.warns(DeprecationWarning, match=told):
        fn = bind_loss(get_registry().get("loss", "old_pg", platform="").load(), LossKnobs.of(rl_cfg),
                       rl_cfg.loss_settings, name="old_pg")  # fmt: skip
    one = {"loss_mask": torch.ones(2), "advantages": torch.ones(2)}
    _, out = fn(torch.zeros(2, requires_grad=True), torch.zeros(2), one)
    assert float(out["old_pg_eps_clip"]) == pytest.approx(0.3)  # the configured value, as a keyword


def test_unknown_names_are_config_errors_naming_the_field(areal_env):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    areal_env()
    with pytest.raises(ConfigError, match=r"algorithm\.advantage.*'sign'.*registered: dr_grpo, gae, grpo"):
        load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), ["algorithm.advantage=sign"], registry=get_registry())
    with pytest.raises(ConfigError, match=r"algorithm\.loss.*'vanilla'.*registered: ppo"):
        load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), ["algorithm.loss=vanilla"], registry=get_registry())


def test_plugin_settings_are_typed_and_arrive_with_the_models_defaults(with_algo_plugin, tiny_llama_dir):
    """``algorithm.<name>`` is validated against the registered config_model;
    the validated values (defaults included) arrive as keywords."""
    from areal_kernel.algo.rl import RLConfig, compute_advantages
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    base = ["algorithm.advantage=sign", "algorithm.loss=vanilla_pg"]
    cfg = load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), [*base, "algorithm.sign={scale: '3'}"], registry=get_registry())
    assert type(cfg.algorithm.advantage_settings).__name__ == "SignSettings"
    assert cfg.algorithm.advantage_settings.scale == 3.0  # coerced by the plugin's model
    rl_cfg = RLConfig.from_config(cfg)
    assert rl_cfg.loss_settings.pg_coef == 1.0  # the model's default: the function has none
    adv, _ = compute_advantages(_fixed_batch(), rl_cfg)
    assert max(abs(a) for row in adv for a in row) == pytest.approx(3.0)
    # Built without a config file: the model's defaults still arrive.
    direct = RLConfig(advantage="sign", loss="vanilla_pg")
    assert direct.advantage_settings.scale == 1.0 and direct.loss_settings.pg_coef == 1.0
    assert cfg.dump()["algorithm"]["sign"] == {"scale": 3.0}  # config.yaml keeps the section


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("algorithm.sign={scale: -1}", ("algorithm.sign.scale", "greater than 0")),
        ("algorithm.sign={scale: big}", ("algorithm.sign.scale", "valid number")),
        ("algorithm.sign={scal: 2}", ("algorithm.sign.scal", "unknown key", "did you mean 'scale'")),
        ("algorithm.vanilla={pg_coef: 2}", ("algorithm.vanilla", "unknown key", "did you mean 'vanilla_pg'")),
        ("algorithm.rloo={x: 1}", ("algorithm.rloo", "advantage 'sign' or loss 'vanilla_pg'")),
        ("algorithm.advantage_kwargs={scale: 2}", ("algorithm.advantage_kwargs", "algorithm.sign")),
    ],
)
def test_bad_plugin_settings_are_one_error_naming_the_field(with_algo_plugin, override, fragments):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(
            str(REPO / "examples" / "grpo_arithmetic.yaml"),
            ["algorithm.advantage=sign", "algorithm.loss=vanilla_pg", override], registry=get_registry(),
        )
    msg = str(info.value)
    assert len(msg.splitlines()) == 1, msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_settings_for_a_name_without_a_config_model_are_refused(areal_env):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    areal_env()
    with pytest.raises(ConfigError, match=r"algorithm\.ppo: loss 'ppo' takes no settings"):
        load_config(str(REPO / "examples" / "grpo_arithmetic.yaml"), ["algorithm.ppo={eps_clip: 0.1}"], registry=get_registry())
