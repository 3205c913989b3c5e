"""areal-npu: Ascend NPUs as an areal-kernel platform.

Importing this package imports nothing but the standard library; the
platform (``areal_npu.platform:NPUPlatform``) imports torch and torch_npu
only inside its methods.
"""

__version__ = "0.1.0"
