"""``areal agent run|ps|status|logs|stop``: a detached agent service.

A service process (``service``) runs N worker processes (``worker``) of an
agent class behind the kernel's agent proxy (``areal_kernel.agent.proxy``):
it hands each worker a record and a proxy session, the worker runs the
agent, the service records the reward and appends the finished session to a
session log. The proxy's model is started by the service itself through the
same code ``areal inf`` uses for a registered model (backend, launcher,
supervisor, client), or, in online RL mode, the proxy is a training run's
(``areal agent serve``). Files live under ``$AREAL_HOME/agent``. See
docs/services.md.
"""
