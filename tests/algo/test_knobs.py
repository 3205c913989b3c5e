"""The shared RL knobs travel as two frozen objects, ``LossKnobs`` and
``AdvantageKnobs`` (areal_kernel/config/knobs.py), each knob with the one
default of ``RLSettings``; losses and estimators get them whole as
``knobs=``, and one written for the old keyword convention still works,
with a ``DeprecationWarning`` naming it."""
from __future__ import annotations

import inspect
import warnings

import pytest

from areal_kernel.algo import estimators as E
from areal_kernel.algo.rl import RLConfig, bind_loss, compute_advantages, knob_arguments, takes_knobs
from areal_kernel.api.advantage_estimator import AdvantageKnobs
from areal_kernel.api.io import Trajectory, TrajectoryBatch
from areal_kernel.api.loss import LossKnobs
from areal_kernel.config.knobs import LEGACY_ESTIMATOR_KEYWORDS, LEGACY_LOSS_KEYWORDS, knobs_with, legacy_keywords
from areal_kernel.config.models import AlgorithmConfig, RLSettings

KNOBS = (LossKnobs, AdvantageKnobs)


@pytest.mark.parametrize("cls", KNOBS)
def test_each_knob_is_the_config_setting_with_its_default(cls):
    """A default written a second time (here or in a function) could drift:
    every knob's type, bounds and default are the RLSettings field's."""
    assert cls.model_fields, cls
    for name, field in cls.model_fields.items():
        setting = RLSettings.model_fields[name]  # KeyError: a knob that is no algorithm setting
        assert field.default == setting.default, name
        assert field.annotation == setting.annotation, name
        assert field.metadata == setting.metadata, name
        assert getattr(cls(), name) == getattr(AlgorithmConfig(), name), name


def test_the_knobs_carry_the_configs_values():
    cfg = RLConfig(eps_clip=0.3, behav_imp_weight_cap=3.0, loss_agg="seq-mean-token-sum", kl_coef=0.1, lam=0.9,
                   gamma=0.99, adv_norm="batch", adv_eps=1e-3, std_normalize=False)  # fmt: skip
    lk, ak = LossKnobs.of(cfg), AdvantageKnobs.of(cfg)
    assert (lk.eps_clip, lk.behav_imp_weight_cap, lk.loss_agg, lk.kl_coef) == (0.3, 3.0, "seq-mean-token-sum", 0.1)
    assert (ak.gamma, ak.lam, ak.adv_norm, ak.adv_eps, ak.std_normalize) == (0.99, 0.9, "batch", 1e-3, False)
    # KL in the reward: the loss's KL weight is 0 (it went into the rewards).
    assert LossKnobs.of(RLConfig(kl_coef=0.1, kl_in="reward")).kl_coef == 0.0
    with pytest.raises(Exception, match="frozen"):
        lk.eps_clip = 0.5  # type: ignore[misc]
    with pytest.raises(Exception, match="greater than 0"):
        LossKnobs(eps_clip=0.0)  # the config's bounds hold for the knobs too


@pytest.mark.parametrize(
    "fn",
    [E.grpo, E.dr_grpo, E.rloo, E.reinforce_pp, E.reinforce_pp_baseline, E.gae],
    ids=lambda f: f.__name__,
)
def test_builtin_estimators_take_knobs_and_restate_no_default(fn):
    params = inspect.signature(fn).parameters
    assert takes_knobs(fn)
    knob_names = set(AdvantageKnobs.model_fields) | set(LEGACY_ESTIMATOR_KEYWORDS)
    assert not knob_names & set(params), f"{fn.__name__} restates knob parameters {sorted(knob_names & set(params))}"


def test_builtin_loss_takes_knobs_and_restates_no_default():
    from areal_kernel.algo.losses import make_ppo_loss_fn, ppo_actor_loss

    for fn in (ppo_actor_loss, make_ppo_loss_fn):
        params = inspect.signature(fn).parameters
        assert "knobs" in params
        assert not set(LossKnobs.model_fields) & set(params), fn.__name__


def test_knobs_with_takes_field_and_old_keyword_names():
    k = knobs_with(AdvantageKnobs, None, {"norm": "none", "eps": 0.0, "lam": 0.5, "unrelated": 1})
    assert (k.adv_norm, k.adv_eps, k.lam, k.gamma) == ("none", 0.0, 0.5, AdvantageKnobs().gamma)
    base = AdvantageKnobs(gamma=0.5)
    assert knobs_with(AdvantageKnobs, base, {}) is base
    assert knobs_with(AdvantageKnobs, base, {"adv_norm": "group"}).gamma == 0.5
    assert legacy_keywords(AdvantageKnobs()) == {
        "gamma": 1.0, "lam": 1.0, "norm": None, "std_normalize": True, "eps": 1e-6,
    }  # fmt: skip
    assert set(LEGACY_LOSS_KEYWORDS) == set(LossKnobs.model_fields)


def test_gae_lambda_default_is_the_configs():
    """``gae`` once defaulted lam=0.95 while the config said 1.0: called
    without knobs it now uses the config's, and lam=0.95 still differs."""
    masks, values = [[0, 1, 1, 1]], [[0.0, 0.5, 0.6, 0.7]]
    default = E.gae([1.0], ["a"], loss_masks=masks, values=values, norm="none").advantages
    config = E.gae([1.0], ["a"], loss_masks=masks, values=values, knobs=AdvantageKnobs(adv_norm="none")).advantages
    other = E.gae([1.0], ["a"], loss_masks=masks, values=values, lam=0.95, norm="none").advantages
    assert default == config
    assert AdvantageKnobs().lam == 1.0 and other != default


def test_ppo_cap_default_is_the_configs():
    """``ppo_actor_loss`` once defaulted behav_imp_weight_cap=None while the
    config said 5.0: a token whose behaviour weight exceeds 5 is now dropped
    without any option given, as in a run with the default config."""
    import torch

    from areal_kernel.algo.losses import ppo_actor_loss

    lp = torch.zeros(2)
    data = {
        "loss_mask": torch.ones(2),
        "advantages": torch.ones(2),
        "old_logprobs": torch.tensor([0.0, -3.0]),  # token 1: weight exp(3) > 5
        "prox_logprobs": torch.zeros(2),
    }
    _, default = ppo_actor_loss(lp, data)
    _, uncapped = ppo_actor_loss(lp, data, knobs=LossKnobs(behav_imp_weight_cap=None))
    _, by_keyword = ppo_actor_loss(lp, data, behav_imp_weight_cap=None)  # a direct caller's keyword still counts
    assert float(default["behav_masked_frac"]) == pytest.approx(0.5)
    assert float(uncapped["behav_masked_frac"]) == 0.0 == float(by_keyword["behav_masked_frac"])


# -- the calling conventions --------------------------------------------------


def new_style_loss(logprobs, data, *, entropy, knobs, **kwargs):
    return knobs, {"kwargs": kwargs}


def old_style_loss(logprobs, data, *, entropy=None, eps_clip, loss_agg, **kwargs):
    return (eps_clip, loss_agg), {"kwargs": kwargs}


def test_a_new_style_loss_gets_the_knobs_object(recwarn):
    knobs = LossKnobs.of(RLConfig(eps_clip=0.3))
    fn = bind_loss(new_style_loss, knobs, {"pg_coef": 0.5})
    got, stats = fn(None, None, {})
    assert got is knobs
    assert stats["kwargs"] == {"pg_coef": 0.5}  # the settings, no knob as a keyword
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    assert fn.needs_entropy_grad is False
    assert bind_loss(new_style_loss, LossKnobs(entropy_coef=0.1)).needs_entropy_grad is True


def test_an_old_style_loss_still_works_and_is_told():
    knobs = LossKnobs.of(RLConfig(eps_clip=0.3, loss_agg="seq-mean-token-mean"))
    with pytest.warns(DeprecationWarning, match=r"old_style_loss.*knobs.*LossKnobs"):
        fn = bind_loss(old_style_loss, knobs, {"pg_coef": 0.5}, name="mine")
    got, stats = fn(None, None, {})
    assert got == (0.3, "seq-mean-token-mean")
    assert set(stats["kwargs"]) == (set(LEGACY_LOSS_KEYWORDS) - {"eps_clip", "loss_agg"}) | {"pg_coef"}


def test_the_old_bind_loss_form_still_works_and_is_told():
    with pytest.warns(DeprecationWarning, match="bind_loss"):
        fn = bind_loss(old_style_loss, {"eps_clip": 0.1, "loss_agg": "token-mean"})
    assert fn(None, None, {})[0] == (0.1, "token-mean")


def _batch() -> TrajectoryBatch:
    return TrajectoryBatch(
        [
            Trajectory(input_ids=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], versions=[0, 0, 0],
                       reward=float(i % 2), group_id="g")  # fmt: skip
            for i in range(2)
        ]
    )


def test_estimators_get_knobs_or_old_keywords():
    cfg = RLConfig(gamma=0.9, lam=0.8, adv_norm="none", adv_eps=1e-3)
    seen: dict = {}

    def new_style(rewards, group_ids, *, loss_masks, token_rewards, values, knobs, **kwargs):
        seen["new"] = (knobs, kwargs)
        return list(rewards)

    def old_style(rewards, group_ids, *, loss_masks, gamma, lam, norm, eps, **kwargs):
        seen["old"] = (gamma, lam, norm, eps)
        return list(rewards)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        compute_advantages(_batch(), cfg, estimator=new_style)
    assert seen["new"] == (AdvantageKnobs.of(cfg), {})
    with pytest.warns(DeprecationWarning, match=r"old_style.*knobs.*AdvantageKnobs"):
        rows, _ = compute_advantages(_batch(), cfg, estimator=old_style)
    assert seen["old"] == (0.9, 0.8, "none", 1e-3)
    assert rows == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]


def test_knob_arguments_of_a_callable_without_signature():
    with pytest.warns(DeprecationWarning):
        assert knob_arguments(max, AdvantageKnobs(), "advantage_estimator", "x")["norm"] is None


def test_the_removed_keyword_lists_are_deprecated_aliases():
    from areal_kernel.algo import losses, rl

    with pytest.warns(DeprecationWarning, match="LossKnobs"):
        assert losses.LOSS_KEYWORDS == ("entropy", *LEGACY_LOSS_KEYWORDS)
    with pytest.warns(DeprecationWarning, match="AdvantageKnobs"):
        assert "gamma" in E.ESTIMATOR_KEYWORDS and "loss_masks" in E.ESTIMATOR_KEYWORDS
    with pytest.warns(DeprecationWarning, match="LossKnobs.of"):
        assert rl.loss_options(RLConfig(eps_clip=0.3))["eps_clip"] == 0.3
    with pytest.raises(AttributeError):
        losses.NOT_A_NAME  # noqa: B018


@pytest.mark.parametrize(
    "kind, field",
    [("loss", "knobs"), ("loss", "entropy"), ("loss", "eps_clip"), ("advantage_estimator", "knobs"),
     ("advantage_estimator", "values"), ("advantage_estimator", "norm")],
)  # fmt: skip
def test_a_setting_named_like_what_the_kernel_passes_is_refused(kind, field):
    """The call keywords (and, while the old convention lives, the knobs' old
    keyword names) could never reach a plugin as its own setting."""
    from pydantic import create_model

    from areal_kernel.config import resolve, validate_config
    from areal_kernel.errors import ConfigError
    from areal_kernel.plugins.registry import FactorySpec, Registry

    reg = Registry()
    names = {
        "train_engine": ["torch"], "inference_engine": ["embedded"], "dataset": ["arithmetic"], "workflow": ["rlvr"],
        "reward": ["math"], "advantage_estimator": ["grpo"], "loss": ["ppo"], "trainer": ["grpo"],
        "metric_sink": ["console", "jsonl", "tensorboard"], "scheduler": ["local"],
    }  # fmt: skip
    for k, kind_names in names.items():
        for name in kind_names:
            reg.add(FactorySpec(k, name, "probe:target", "probe"))
    settings = create_model("Clash", **{field: (float, 1.0)})
    reg.add(FactorySpec(kind, "mine", "probe:target", "probe", config_model=settings))
    key = "loss" if kind == "loss" else "advantage"
    with pytest.raises(ConfigError, match=rf"algorithm\.mine: .* field\(s\) {field}, which the kernel already passes"):
        resolve(validate_config({"algorithm": {key: "mine"}}), reg)
    # A knob's field name that is no keyword of either convention is free (adv_eps arrives as knobs.adv_eps).
    if kind == "advantage_estimator":
        reg.add(FactorySpec(kind, "free", "probe:target", "probe", config_model=create_model("Free", adv_eps=(float, 1.0))))
        assert resolve(validate_config({"algorithm": {key: "free"}}), reg).algorithm.advantage_settings.adv_eps == 1.0
