"""areal-kernel: asynchronous RL post-training for LLMs, as a kernel plus plugins.

Importing this package is cheap (no torch): heavy libraries load inside the
factories that need them.
"""

from areal_kernel.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
