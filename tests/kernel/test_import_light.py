"""`import areal_kernel` (and the plugin machinery, config and CLI) must not import torch, nor matplotlib
(only `areal report`'s drawing imports it)."""
import subprocess
import sys

import pytest

LIGHT_MODULES = [
    "areal_kernel",
    "areal_kernel.plugins",
    "areal_kernel.config",
    "areal_kernel.cli",
    "areal_kernel.builtin",
    "areal_kernel.platforms",
    "areal_kernel.api.io",
    "areal_kernel.api.engine",
    "areal_kernel.hookspecs",
    "areal_kernel.tools",
    "areal_kernel.tools.hermes",
    "areal_kernel.tools.builtin_tools",
    "areal_kernel.workflow.multi_turn_config",
    "areal_kernel.report",
    "areal_kernel.report.rundir",
    "areal_kernel.report.panels",
    "areal_kernel.report.inspect_step",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_does_not_import_torch(module):
    code = (
        f"import sys, {module}; heavy = [m for m in ('torch', 'transformers', 'datasets', 'vllm', 'matplotlib') if m in sys.modules];"
        "print(','.join(heavy)); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{module} imported heavy modules: {proc.stdout} {proc.stderr}"


def test_loading_every_plugin_and_validating_defaults_stays_light(plugin_env):
    # Registration and config validation import config models only, never engines.
    code = (
        "import sys; from areal_kernel.config import load_config; load_config(None);"
        "from areal_kernel.plugins import get_registry; get_registry();"
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules];"
        "print(','.join(heavy)); sys.exit(1 if heavy else 0)"
    )
    import os

    env = {**os.environ, **plugin_env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
