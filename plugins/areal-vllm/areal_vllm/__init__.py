"""areal-vllm: vLLM inference servers as an areal-kernel rollout backend.

Light on purpose: importing this package (or its entry-point module
``areal_vllm.plugin``) imports only ``areal_kernel``; vLLM is imported in
the server processes (``worker_ext``, ``transfer``) and nowhere else.
"""

__version__ = "0.1.0"
