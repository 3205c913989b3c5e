"""``areal inf``: a local inference service.

A detached gateway process (``gateway``) routes OpenAI-compatible requests
by ``model`` name to the replicas of registered models; each model's
replicas are started by its inference backend's launcher, restarted by the
kernel's server supervisor, and reached through the backend's client. The
CLI (``cli``) talks to the gateway over HTTP and reads its files under
``$AREAL_HOME/inf`` (``state``). See docs/services.md.
"""
