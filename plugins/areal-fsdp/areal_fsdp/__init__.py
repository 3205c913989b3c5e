"""areal-fsdp: the PyTorch FSDP2 train engine as an areal-kernel plugin.

Importing this package is light (no torch): the engine lives in
``areal_fsdp.engine`` (controller side) and ``areal_fsdp.rank`` (the rank
processes), both imported only when ``actor.backend: fsdp`` is selected.
"""

__version__ = "0.1.0"
