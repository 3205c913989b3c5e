"""Registers the fault-injecting rewards and loss; imports only areal_kernel."""
from areal_kernel import hookimpl

_IMPL = "areal_fault_inject.fault_impl"


@hookimpl
def areal_register_rewards(register):
    register("fault_raise_some", f"{_IMPL}:raise_some_reward", description="raises for answers = 3 (mod 4), else 1.0")
    register("fault_hang_first", f"{_IMPL}:hang_first_reward", description="the first N calls sleep forever, else 1.0")
    register("fault_always_raise", f"{_IMPL}:always_raise_reward", description="raises on every call")
    register("fault_spread", f"{_IMPL}:spread_reward", description="a hash of the completion in [0, 1)")


@hookimpl
def areal_register_losses(register):
    register(
        "fault_nan_ppo",
        f"{_IMPL}:nan_ppo_loss",
        config_model=f"{_IMPL}:NanLossSettings",  # algorithm.fault_nan_ppo: {nan_steps: [...]}
        description="the ppo loss, NaN on the steps in nan_steps",
    )


@hookimpl
def areal_register_workflows(register):
    register(
        "fault_hot_rlvr",
        f"{_IMPL}:HotSamplerWorkflow",
        config_model=f"{_IMPL}:HotSamplerSettings",  # workflow.fault_hot_rlvr: {temperature_factor: ...}
        description="rlvr whose requests ask the servers for temperature_factor x the configured temperature",
    )


@hookimpl
def areal_register_weight_transports(register):
    register(
        "fault_corrupt_disk",
        f"{_IMPL}:CorruptingDiskTransport",
        description="disk updates; with AREAL_FAULT_CORRUPT=<version>:<tensor> one tensor of that update is "
        "changed on disk before the servers load it",
    )


@hookimpl(tryfirst=True)
def areal_select_weight_transport(train_backend, inference_backend, platform, mode):
    import os

    # Set (to a fault or to "none", the clean twin): every update goes through the wrapper.
    return "fault_corrupt_disk" if os.environ.get("AREAL_FAULT_CORRUPT") or os.environ.get("AREAL_FAULT_STALE") else None
