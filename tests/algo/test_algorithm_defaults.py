"""One definition and one default per algorithm setting: ``RLSettings``
(areal_kernel/config/models.py). ``AlgorithmConfig`` (what users write) and
``RLConfig`` (what the RL step reads) inherit the fields without restating
them, and ``RLConfig.from_config`` (what ``areal train``'s RL trainer calls)
carries exactly the config's values."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from areal_kernel.algo.rl import RLConfig
from areal_kernel.config import load_config, resolve
from areal_kernel.plugins import get_registry
from areal_kernel.config.models import AlgorithmConfig, ExperimentConfig, GenerationSettings, RLSettings

REPO = Path(__file__).resolve().parents[2]

# The documented defaults (docs/algorithms.md); these are what a config
# without an algorithm section runs with today.
DOCUMENTED = {
    "advantage": "grpo", "loss": "ppo", "eps_clip": 0.2, "eps_clip_high": None, "behav_imp_weight_cap": 5.0,
    "recompute_proximal": True, "std_normalize": True, "adv_eps": 1e-6, "kl_coef": 0.0, "kl_estimator": "k3",
    "entropy_coef": 0.0, "adv_norm": None, "gamma": 1.0, "lam": 1.0, "reward_scale": 1.0, "reward_bias": 0.0,
    "reward_clip": None, "overlong_buffer_len": None, "overlong_penalty_factor": 1.0, "dual_clip": None,
    "ratio_level": "token", "behav_imp_weight_mode": "mask", "kl_in": "loss", "loss_agg": "token-mean",
    "prox_interpolate": False, "ppo_n_minibatches": 1, "value_eps_clip": 0.2,
}  # fmt: skip


def _declared_fields(cls: type) -> set[str]:
    """Fields a class itself declares (annotations in its own body)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    return {n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_each_rl_setting_is_declared_once():
    rl = set(RLSettings.model_fields)
    assert rl == set(DOCUMENTED)
    for cls in (AlgorithmConfig, RLConfig):
        restated = _declared_fields(cls) & rl
        assert not restated, f"{cls.__name__} restates {sorted(restated)}: declare them only in RLSettings"
        assert issubclass(cls, RLSettings)


def test_empty_config_gives_the_documented_defaults_everywhere(areal_env):
    areal_env()
    cfg = resolve(ExperimentConfig(), get_registry())  # the parsed defaults, resolved as areal train does
    from_file = load_config("/dev/null", [], registry=get_registry())
    direct = RLConfig()
    seen_by_trainer = RLConfig.from_config(cfg)
    for name, value in DOCUMENTED.items():
        assert getattr(cfg.algorithm, name) == value, name
        assert getattr(from_file.algorithm, name) == value, name
        assert getattr(direct, name) == value, name
        assert getattr(seen_by_trainer, name) == value, name
    # The fields from other sections: their defaults are those sections' own.
    assert seen_by_trainer.temperature == direct.temperature == GenerationSettings().temperature
    assert seen_by_trainer.max_new_tokens == GenerationSettings().max_new_tokens


def _changed(name: str, value):
    """A valid value different from the default, for each kind of field."""
    other = {
        "advantage": "rloo", "eps_clip_high": 0.28, "behav_imp_weight_cap": 3.0, "recompute_proximal": False,
        "kl_estimator": "k1", "adv_norm": "batch", "reward_clip": 2.0, "overlong_buffer_len": 4, "dual_clip": 3.0,
        "ratio_level": "sequence", "behav_imp_weight_mode": "clamp", "kl_in": "reward", "loss_agg": "seq-mean-token-sum",
        "prox_interpolate": True, "ppo_n_minibatches": 2, "value_eps_clip": 0.5, "std_normalize": False,
    }  # fmt: skip
    if name in other:
        return other[name]
    if name == "loss":
        return "ppo"  # the only registered loss; its own default elsewhere
    assert isinstance(value, (int, float)), name
    return value + 0.25 if isinstance(value, float) and value < 1 else value * 0.5


def test_the_trainer_sees_exactly_the_configs_values(areal_env):
    areal_env()
    overrides = [f"algorithm.{n}={_changed(n, v)}" for n, v in DOCUMENTED.items() if n != "loss"]
    overrides = [o.replace("=None", "=null") for o in overrides]
    cfg = load_config("/dev/null", [*overrides, "rollout.gconfig.temperature=0.7", "rollout.gconfig.max_new_tokens=9"], registry=get_registry())
    rl = RLConfig.from_config(cfg)
    for name in DOCUMENTED:
        if name == "loss":
            continue
        assert getattr(cfg.algorithm, name) != DOCUMENTED[name], name  # the override took
        assert getattr(rl, name) == getattr(cfg.algorithm, name), name
    assert (rl.temperature, rl.max_new_tokens) == (0.7, 9)


def test_rl_trainer_builds_its_step_options_from_the_config():
    """The RL loop has no hand copy of the settings: it calls RLConfig.from_config."""
    src = (REPO / "areal_kernel" / "trainer" / "run.py").read_text()
    assert "RLConfig.from_config(cfg)" in src
    assert "RLConfig(" not in src


@pytest.mark.parametrize("bad", ["algorithm.eps_clip=0", "algorithm.behav_imp_weight_cap=1"])
def test_config_constraints_hold_for_the_step_options_too(bad, areal_env):
    """One definition: a value the config refuses, RLConfig refuses as well."""
    from areal_kernel.errors import ConfigError

    areal_env()
    with pytest.raises(ConfigError):
        load_config("/dev/null", [bad], registry=get_registry())
    name, _, value = bad.partition("=")
    with pytest.raises(Exception, match=name.split(".")[1]):
        RLConfig(**{name.split(".")[1]: float(value)})
