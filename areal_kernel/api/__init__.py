"""Public data structures and protocols of the kernel (no torch at import time)."""
