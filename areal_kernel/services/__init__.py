"""Long-running operator services built on the kernel's parts.

- ``areal_kernel.services.inf``: ``areal inf``, a local gateway serving
  registered models through OpenAI-compatible routes (docs/services.md).
"""
