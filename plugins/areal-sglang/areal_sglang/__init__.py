"""areal-sglang: SGLang inference servers as an areal-kernel rollout backend.

Importing this package (or the entry-point module ``areal_sglang.plugin``)
imports only ``areal_kernel``: SGLang runs in the server processes that the
launcher starts, never in the controller.
"""

__version__ = "0.1.0"

# The SGLang release whose argument parser and request classes the tests
# checked our command lines and request bodies against.
SGLANG_VERSION = "0.5.23"
