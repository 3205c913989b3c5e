"""Built-in single-process PyTorch train engine.

Import ``areal_kernel.engine.torch_engine`` for the engine itself; this package
file stays free of torch so that ``import areal_kernel.engine`` is cheap.
"""

from areal_kernel.engine.config import TorchEngineConfig

__all__ = ["TorchEngineConfig"]
