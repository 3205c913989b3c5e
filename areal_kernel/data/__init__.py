"""Datasets: local files / Hub datasets as records, the built-in arithmetic
task, and deterministic splits. Heavy imports (``datasets``) happen on use."""

from areal_kernel.data.arithmetic import arithmetic_records, arithmetic_splits
from areal_kernel.data.loaders import load_records
from areal_kernel.data.split import train_eval_split

__all__ = ["arithmetic_records", "arithmetic_splits", "load_records", "train_eval_split"]
