"""The embedded inference server: a separate process serving a transformers
causal LM over HTTP with batched generation, per-token logprobs,
pause/resume/abort and weight reload (disk or in-memory broadcast).

Modules: ``protocol`` (request parsing), ``sampling`` (vectorized sampling),
``kvbatch`` (the running batch and its KV cache), ``engine`` (the generation
thread), ``server`` (HTTP, ``python -m areal_kernel.inference.embedded.server``),
``launcher`` (starting/stopping server processes), ``ports``.
Only ``protocol``, ``launcher`` and ``ports`` are importable without torch.
"""
