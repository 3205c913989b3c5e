"""Paths shared by the offline-trainer tests (a uniquely named module: several
test directories have a conftest.py, so ``from conftest import`` is ambiguous)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
