"""areal-megatron: a Megatron-Core train engine as an areal-kernel plugin.

Importing this package is light (no torch, no megatron): the engine lives in
``areal_megatron.engine`` (controller side) and ``areal_megatron.rank`` (the
rank processes), imported only when ``actor.backend: megatron...`` is chosen.
"""

__version__ = "0.1.0"
