"""RL algorithm parts as plain functions: advantage estimators, losses, and
the GRPO step glue. ``advantages`` is pure Python; ``losses`` imports torch
only when called; nothing here imports torch at package import time."""
