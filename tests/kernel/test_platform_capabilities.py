"""Decisions that used to compare device strings or factory names now come
from the Platform object and registered declarations, which a third party
can provide without editing the kernel."""
import pytest

from areal_kernel import hookimpl
from areal_kernel.config import load_config
from areal_kernel.errors import ConfigError
from areal_kernel.platforms import Platform
from areal_kernel.platforms.base import CpuPlatform, CudaPlatform
from areal_kernel.plugins.manager import PluginManager, PluginRecord
from areal_kernel.plugins import get_registry


class _ThirdPartyAccel(Platform):
    # What an NPU plugin writes: only identity, no capability overrides.
    name = "fakeaccel"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    def device_count(self) -> int:
        return 4


def test_an_accelerator_subclass_gets_accelerator_answers_without_overrides():
    p = _ThirdPartyAccel()
    assert not p.host_memory and p.exclusive_devices and not p.collectives_on_host
    assert p.prefers_in_memory_weight_updates and not p.fused_masked_gqa_attention
    assert p.compute_units() == 4 and p.compute_unit_name == "npu devices"
    assert p.describe()["exclusive_devices"] is True


def test_cpu_and_cuda_answer_every_capability():
    cpu, cuda = CpuPlatform(), CudaPlatform()  # properties touch no driver
    assert cpu.host_memory and not cpu.exclusive_devices and cpu.collectives_on_host
    assert not cpu.prefers_in_memory_weight_updates and cpu.fused_masked_gqa_attention
    assert not cpu.supports_cpu_offload and cpu.device_rng_state() is None
    assert cpu.compute_units() >= 1 and cpu.compute_unit_name == "CPU cores"
    assert not cuda.host_memory and cuda.exclusive_devices and not cuda.collectives_on_host
    assert cuda.prefers_in_memory_weight_updates and cuda.supports_cpu_offload


class _ServerDefaultsAccel(_ThirdPartyAccel):
    name = "defaultsaccel"

    def inference_server_defaults(self, backend):
        return {"embedded": {"max_batch_size": 3, "seed": 9}, "broken": {"no_such_field": 1}}.get(backend, {})


def test_platform_server_defaults_fill_only_what_the_user_left_unset():
    from areal_kernel.inference.embedded.launcher import EmbeddedServerConfig

    p = _ServerDefaultsAccel()
    got = p.apply_server_defaults("embedded", EmbeddedServerConfig(seed=1))
    assert (got.max_batch_size, got.seed) == (3, 1)  # the user's seed wins
    untouched = EmbeddedServerConfig(seed=1)
    assert p.apply_server_defaults("other", untouched) is untouched
    assert CpuPlatform().apply_server_defaults("embedded", untouched) is untouched
    with pytest.raises(ConfigError, match=r"platform 'defaultsaccel' gives rollout.broken the setting\(s\) \['no_such_field'\]"):
        p.apply_server_defaults("broken", untouched)


def test_platform_builds_gloo_groups_and_names_what_it_cannot_build():
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    pg = CpuPlatform().new_process_group("gloo", store, 0, 1, datetime.timedelta(seconds=5))
    assert isinstance(pg, dist.ProcessGroupGloo)
    with pytest.raises(ConfigError, match=r"collective backend 'warpnet' cannot be built on platform 'cpu'"):
        CpuPlatform().new_process_group("warpnet", store, 0, 1, datetime.timedelta(seconds=5))


def test_math_reward_declares_its_worker_preload():
    spec = get_registry().get("reward", "math", platform="")
    assert spec.worker_preload == ("areal_kernel.reward.math:warmup",)
    assert get_registry().get("reward", "exact_match", platform="").worker_preload == ()


def test_worker_preload_is_for_rewards_and_must_name_a_module():
    @hookimpl
    def areal_register_rewards(register):
        register("heavy", "pkg.mod:fn", worker_preload=["pkg.heavy", "pkg.heavy:warm"])

    @hookimpl
    def areal_register_datasets(register):
        register("odd", "pkg.mod:fn", worker_preload=["pkg.heavy"])

    @hookimpl
    def areal_register_rewards_bad(register):
        register("bad", "pkg.mod:fn", worker_preload=["a:b:c"])

    import types

    pm = PluginManager()
    pm.ensure_loaded()
    pm._register_module(PluginRecord("good", "m"), types.SimpleNamespace(areal_register_rewards=areal_register_rewards))
    assert pm.registry.get("reward", "heavy", platform="").worker_preload == ("pkg.heavy", "pkg.heavy:warm")
    pm._register_module(PluginRecord("odd", "m"), types.SimpleNamespace(areal_register_datasets=areal_register_datasets))
    assert pm.records["odd"].status == "failed" and "only rewards" in pm.records["odd"].error
    pm._register_module(PluginRecord("bad", "m"), types.SimpleNamespace(areal_register_rewards=areal_register_rewards_bad))
    assert pm.records["bad"].status == "failed" and "worker_preload" in pm.records["bad"].error


def test_settings_section_is_for_trainers_with_settings():
    """A trainer may read a shared algorithm section (the kernel's ipo reads
    algorithm.dpo); the option is refused elsewhere, naming the plugin."""
    import types

    def plugin(kind, *args, **kwargs):
        @hookimpl(specname=f"areal_register_{kind}")
        def hook(register):
            register(*args, **kwargs)

        return types.SimpleNamespace(hook=hook)

    pm = PluginManager()
    pm.ensure_loaded()
    model = "areal_kernel.config.offline:DPOConfig"
    good = plugin("trainers", "pair2", "p.m:T", config_model=model, settings_section="dpo")
    pm._register_module(PluginRecord("good", "m"), good)
    assert pm.records["good"].status == "loaded", pm.records["good"].error
    assert pm.registry.get("trainer", "pair2", platform="").section == "dpo"
    assert get_registry().get("trainer", "ipo", platform="").section == "dpo"
    assert get_registry().get("trainer", "dpo", platform="").section == "dpo"
    for name, kind, kwargs, says in (
        ("loss_sec", "losses", {"config_model": model, "settings_section": "dpo"}, "only trainers"),
        ("no_model", "trainers", {"settings_section": "dpo"}, "no config_model"),
        ("bad_name", "trainers", {"config_model": model, "settings_section": "a.b"}, "expected a name"),
    ):
        pm._register_module(PluginRecord(name, "m"), plugin(kind, name, "p.m:T", **kwargs))
        assert pm.records[name].status == "failed" and says in pm.records[name].error, pm.records[name].error
        assert f"plugin '{name}'" in pm.records[name].error


def test_capabilities_the_kernel_reads_are_declared_by_the_builtins():
    reg = get_registry()
    assert "needs_values" in reg.get("advantage_estimator", "gae", platform="").capabilities
    assert {"critic", "reward_model"} <= reg.get("train_engine", "torch", platform="").capabilities
    # areal-fsdp is installed with the suite (make install); it has no value
    # model, so it must not claim one.
    fsdp = reg.find("train_engine", "fsdp")
    assert fsdp is not None, "areal-fsdp is not registered: the suite runs with every plugin in plugins/ installed"
    assert "critic" not in fsdp.capabilities


def test_a_critic_on_an_engine_without_the_capability_is_one_clear_error():
    from areal_kernel.trainer.run import needs_critic

    assert needs_critic(load_config(None, ["algorithm.advantage=gae"], registry=get_registry())) is True
    assert needs_critic(load_config(None, registry=get_registry())) is False
    assert get_registry().find("train_engine", "fsdp") is not None, "areal-fsdp (installed with the suite) is not registered"
    cfg = load_config(None, ["algorithm.advantage=gae", "actor.backend=fsdp:d2"], registry=get_registry())
    with pytest.raises(ConfigError, match="does not declare the 'critic' capability") as e:
        needs_critic(cfg)
    assert "torch" in str(e.value)
