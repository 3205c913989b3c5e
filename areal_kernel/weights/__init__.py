"""Weight transport between a train engine and inference servers.

``disk``: safetensors directories (atomic write, no pickles).
``broadcast``: in-memory transfer over a private torch.distributed group.
``apply``: copy named tensors into a live model (tied embeddings handled).

Submodules import torch; this package file does not.
"""
