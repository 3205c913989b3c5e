"""Long-running operator services built on the kernel's parts.

- ``areal_kernel.services.inf``: ``areal inf``, a local gateway serving
  registered models through OpenAI-compatible routes (docs/services.md).
- ``areal_kernel.services.agent``: ``areal agent run``, N workers of an agent
  class behind the agent proxy, feeding a session log or a training run.
- ``areal_kernel.services.detached``: what both share: a detached process
  found through its state file, started, probed, stopped, and its CLI's
  plumbing; each service describes itself with a ``DetachedService``.
"""
