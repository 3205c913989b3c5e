"""Device platforms: the one place that knows about device kinds.

Nothing else in the kernel or its plugins branches on the device: they ask
``current_platform()`` for the device, the distributed backend, the
visible-devices variable and so on.
"""

from areal_kernel.platforms.base import Platform
from areal_kernel.platforms.current import current_platform, platform_named, reset_current_platform

__all__ = ["Platform", "current_platform", "platform_named", "reset_current_platform"]
