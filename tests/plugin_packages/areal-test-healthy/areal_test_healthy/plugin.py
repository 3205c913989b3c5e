"""A small third-party plugin used by the kernel's tests.

Its entry-point module imports only areal_kernel (and the stdlib); what it
registers lives in ``impl.py``, imported only when selected.
"""
import os

from areal_kernel import hookimpl


@hookimpl
def areal_register_rewards(register):
    register("shout_match", "areal_test_healthy.impl:shout_match", description="case-insensitive exact match")


@hookimpl
def areal_register_train_engines(register):
    register(
        "toy",
        "areal_test_healthy.impl:ToyEngine",
        config_model="areal_test_healthy.impl:ToyEngineConfig",
        capabilities=["test-only"],
        description="test-only engine with its own validated config section",
    )
    register(
        "gpu_only",
        "areal_test_healthy.impl:ToyEngine",
        platforms=["cuda", "npu"],
        description="test-only engine that declares accelerator platforms",
    )


@hookimpl
def areal_register_platforms(register):
    register("testaccel", "areal_test_healthy.impl:TestAccelPlatform", description="test-only platform")


@hookimpl
def areal_on_run_start(config, run_dir):
    path = os.environ.get("AREAL_TEST_OBSERVER_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"run_start {config.experiment_name}\n")


def probe_testaccel():
    """Cheap out-of-tree platform probe: present only when the test asks for it."""
    return "areal_test_healthy.impl:TestAccelPlatform" if os.environ.get("AREAL_TEST_ACCEL") == "1" else None
