"""Configuration: pydantic models, YAML loading, overrides, allocation strings."""

from areal_kernel.config.allocation import Allocation, parse_allocation
from areal_kernel.config.loader import json_schema, load_config, read_yaml, validate_config
from areal_kernel.config.models import ExperimentConfig

__all__ = [
    "Allocation",
    "ExperimentConfig",
    "json_schema",
    "load_config",
    "parse_allocation",
    "read_yaml",
    "validate_config",
]
