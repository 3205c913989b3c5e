"""Configuration: pydantic models, YAML loading, overrides, allocation strings.

Below the plugin layer: parsing checks a config's shape; ``resolve(config,
registry)`` checks its plugin names and settings against a registry it is given.
"""

from areal_kernel.config.allocation import Allocation, parse_allocation
from areal_kernel.config.loader import json_schema, load_config, read_yaml, validate_config
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.config.resolve import PluginLookup, resolve

__all__ = [
    "Allocation",
    "ExperimentConfig",
    "PluginLookup",
    "json_schema",
    "load_config",
    "parse_allocation",
    "read_yaml",
    "resolve",
    "validate_config",
]
