"""Paths shared by the end-to-end tests (a uniquely named module: several
test directories have a conftest.py, so ``from conftest import`` is ambiguous)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")
