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


def test_the_default_platform_check_asks_whoever_made_the_registry():
    """The registry sits below the platform layer: its default platform check
    uses the callable its owner gave it (the plugin manager's platform)."""
    from areal_kernel.errors import PlatformNotSupportedError

    gpu_only = FactorySpec("train_engine", "gpu_only", "a:b", "p", platforms=("cuda",))
    seen = []
    reg = Registry(platform_name=lambda: seen.append(1) or "cpu")
    reg.add(gpu_only)
    reg.add(FactorySpec("train_engine", "anywhere", "a:b", "p"))
    with pytest.raises(PlatformNotSupportedError, match="supports platforms cuda; the current platform is 'cpu'"):
        reg.get("train_engine", "gpu_only")
    assert reg.get("train_engine", "gpu_only", platform="cuda") is gpu_only
    n = len(seen)
    reg.get("train_engine", "anywhere")  # supports every platform: the current one is not asked
    assert len(seen) == n == 1
    # Filled by hand without an owner: only a platform passed explicitly is checked.
    hand = Registry()
    hand.add(gpu_only)
    assert hand.get("train_engine", "gpu_only") is gpu_only
    with pytest.raises(PlatformNotSupportedError):
        hand.get("train_engine", "gpu_only", platform="cpu")


def test_the_plugin_manager_holds_the_platform_its_registry_checks_against(areal_env):
    from areal_kernel.platforms import current_platform, reset_current_platform
    from areal_kernel.plugins import get_plugin_manager

    areal_env(AREAL_PLATFORM="cpu")
    pm = get_plugin_manager()
    assert current_platform() is pm.platform() and pm.platform().name == "cpu"
    assert pm.registry.platform_name is not None and pm.registry.platform_name() == "cpu"
    reset_current_platform()
    assert pm._platform is None and current_platform() is pm.platform()
