"""The registry and the guarded loading of plugins, in-process."""
import types

import pytest

from areal_kernel import hookimpl
from areal_kernel.errors import PluginLoadError, PluginNotFoundError
from areal_kernel.plugins.manager import PluginManager, PluginRecord
from areal_kernel.plugins.registry import FactorySpec, Registry


def _module(**hooks):
    return types.SimpleNamespace(**hooks)


def test_registration_failure_is_recorded_and_names_removed():
    @hookimpl
    def areal_register_rewards(register):
        register("half_done", "pkg.mod:fn")
        raise RuntimeError("boom in registration")

    pm = PluginManager()
    pm.ensure_loaded()
    pm._register_module(PluginRecord("bad", "bad_module", "bad-dist", "1.0"), _module(areal_register_rewards=areal_register_rewards))
    rec = pm.records["bad"]
    assert rec.status == "failed" and "boom in registration" in rec.error
    assert pm.registry.find("reward", "half_done") is None
    with pytest.raises(PluginLoadError, match="boom in registration"):
        pm.registry.get("reward", "bad", platform="")


def test_eager_target_is_rejected():
    @hookimpl
    def areal_register_rewards(register):
        register("eager", lambda c, a: 1.0)

    pm = PluginManager()
    pm.ensure_loaded()
    pm._register_module(PluginRecord("eager", "m"), _module(areal_register_rewards=areal_register_rewards))
    assert pm.records["eager"].status == "failed"
    assert "expected a lazy 'package.module:Attribute' string" in pm.records["eager"].error


def test_misspelt_hook_is_a_load_failure():
    @hookimpl
    def areal_register_rewardz(register):
        pass

    pm = PluginManager()
    pm.ensure_loaded()
    pm._register_module(PluginRecord("typo", "m"), _module(areal_register_rewardz=areal_register_rewardz))
    assert pm.records["typo"].status == "failed"
    assert "areal_register_rewardz" in pm.records["typo"].error


def test_loading_is_idempotent():
    pm = PluginManager()
    pm.ensure_loaded()
    n = len(pm.registry.specs())
    pm.ensure_loaded()
    assert len(pm.registry.specs()) == n and n > 0


def test_conflicts_keep_the_first_and_external_may_override_builtin():
    reg = Registry()
    reg.add(FactorySpec("reward", "math", "a:b", "builtin"), builtin=True)
    reg.add(FactorySpec("reward", "math", "c:d", "thirdparty"))
    assert reg.find("reward", "math").plugin == "thirdparty"
    reg.add(FactorySpec("reward", "math", "e:f", "another"))
    assert reg.find("reward", "math").plugin == "thirdparty"
    assert any("registered by both 'thirdparty' and 'another'" in c for c in reg.conflicts)


def test_target_import_failure_keeps_the_real_cause():
    spec = FactorySpec("reward", "x", "areal_kernel_no_such_module:fn", "someplugin")
    with pytest.raises(PluginLoadError) as e:
        spec.load()
    assert "plugin 'someplugin'" in str(e.value) and "No module named 'areal_kernel_no_such_module'" in str(e.value)


def test_unknown_kind_and_name_messages():
    reg = Registry()
    with pytest.raises(ValueError, match="unknown registry kind"):
        reg.get("rewardz", "x")
    with pytest.raises(PluginNotFoundError, match="No reward is registered"):
        reg.get("reward", "x", platform="")


def test_every_builtin_target_and_config_model_imports():
    from areal_kernel.plugins import get_plugin_manager

    pm = get_plugin_manager().ensure_loaded()
    builtin = [s for s in pm.registry.specs() if s.plugin == "builtin"]
    kinds = {s.kind for s in builtin}
    assert {"train_engine", "inference_engine", "dataset", "reward", "workflow", "platform", "metric_sink"} <= kinds
    for spec in builtin:
        assert spec.load() is not None, spec
        spec.config_model_cls()


def test_observer_hooks_reach_plugins(with_test_plugins, tmp_path, monkeypatch):
    out = tmp_path / "observed.txt"
    monkeypatch.setenv("AREAL_TEST_OBSERVER_FILE", str(out))
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins import get_plugin_manager

    get_plugin_manager().hook.areal_on_run_start(config=load_config(None, registry=get_registry()), run_dir=str(tmp_path))
    assert out.read_text() == "run_start areal-run\n"


def test_override_hook_defaults():
    from areal_kernel.plugins import get_plugin_manager

    hook = get_plugin_manager().hook
    assert hook.areal_select_weight_transport(train_backend="torch", inference_backend="embedded", platform="cpu", mode="disk") == "disk"
    assert hook.areal_select_weight_transport(train_backend="torch", inference_backend="embedded", platform="cpu", mode="auto") == "disk"
    assert hook.areal_select_weight_transport(train_backend="torch", inference_backend="embedded", platform="cuda", mode="auto") == "broadcast"
    assert hook.areal_select_scheduler(config=None) == "local"


def test_success_threshold_is_a_reward_setting_and_must_be_a_number():
    @hookimpl
    def areal_register_rewards(register):
        register("partial", "pkg.mod:fn", success_threshold=0.9)

    @hookimpl
    def areal_register_datasets(register):
        register("odd", "pkg.mod:fn", success_threshold=1.0)

    pm = PluginManager()
    pm.ensure_loaded()
    pm._register_module(PluginRecord("good", "m"), _module(areal_register_rewards=areal_register_rewards))
    assert pm.registry.get("reward", "partial", platform="").success_threshold == 0.9
    assert pm.registry.get("reward", "math", platform="").success_threshold == 1.0  # the built-ins declare theirs
    pm._register_module(PluginRecord("odd", "m"), _module(areal_register_datasets=areal_register_datasets))
    assert pm.records["odd"].status == "failed" and "only rewards have one" in pm.records["odd"].error

    @hookimpl
    def areal_register_rewards_bad(register):
        register("nan_threshold", "pkg.mod:fn", success_threshold=float("nan"))

    pm._register_module(PluginRecord("nan", "m"), _module(areal_register_rewards=areal_register_rewards_bad))
    assert pm.records["nan"].status == "failed" and "expected a finite number" in pm.records["nan"].error
