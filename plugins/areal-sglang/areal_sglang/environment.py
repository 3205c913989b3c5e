"""The ``sglang`` managed environment (``areal env create sglang``): what a
Python environment needs to run this plugin's servers.

The pin is the SGLang release whose commands and request bodies this
plugin is checked against (``tests/oracle-requirements.txt``). SGLang
ships one distribution; it needs a CUDA (or ROCm/NPU) device to serve,
which these CPU machines lack, so here the environment can be built and
probed but its servers cannot run (the plugin's tests use a stand-in).
Torch matters: in-memory weight updates speak torch's collective wire
format with the trainer.
"""

from __future__ import annotations

from areal_kernel.api.environment import EnvironmentContext, EnvironmentSpec
from areal_kernel.environments import extra_requirements


# The extra of areal-sglang whose pins `areal env create sglang` installs,
# per platform name (data: SGLang names its builds per device); the cuda
# one elsewhere.
EXTRA = {"npu": "npu"}


def sglang_environment(ctx: EnvironmentContext) -> EnvironmentSpec:
    return EnvironmentSpec(
        requirements=extra_requirements("areal-sglang", EXTRA.get(ctx.platform, "cuda")),
        needs=("sglang>=0.5.23,<0.6",),
        torch_matters=True,
        description="SGLang servers (rollout.backend: sglang)",
    )
