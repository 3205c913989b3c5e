"""``key.sub=value`` command-line overrides, applied to the raw config dict.

Values are parsed as YAML, so ``5``, ``0.1``, ``true``, ``null``, ``[1, 2]``
and ``{a: 1}`` arrive typed; pydantic validation happens afterwards on the
whole config.
"""

from __future__ import annotations

from typing import Any

import yaml

from areal_kernel.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. trainer.max_steps=10)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: empty segment in key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        # One line: the parser's problem and the column in the value, not its multi-line dump.
        mark = getattr(e, "problem_mark", None)
        where = f" at column {mark.column + 1} of the value" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"override {text!r}: value is not valid YAML ({problem}{where}); quote strings, write lists as [a, b]"
        ) from None
    stripped = raw.strip()
    # "torch:" or "a: b" parse as YAML mappings; only an explicit {...} / [...]
    # means a dict or list on the command line.
    if isinstance(value, dict) and not stripped.startswith("{"):
        value = stripped
    elif isinstance(value, list) and not stripped.startswith("["):
        value = stripped
    if isinstance(value, str):
        value = _maybe_number(value)
    return parts, value


def _maybe_number(s: str) -> Any:
    # YAML 1.1 reads "1e-5" as a string; users mean a float.
    try:
        return float(s) if any(c in s.lower() for c in "e.") and s.strip() else s
    except ValueError:
        return s


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return ``data`` with each override applied (creating nested dicts)."""
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[_index(part, node, parts[: i + 1], text)]
                continue
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {text!r}: '{'.'.join(parts[:i])}' is a {type(node).__name__}, not a section"
                )
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            node[_index(last, node, parts, text)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"override {text!r}: '{'.'.join(parts[:-1])}' is a {type(node).__name__}, not a section")
    return data


def _index(part: str, node: list, path: list[str], text: str) -> int:
    try:
        idx = int(part)
    except ValueError:
        raise ConfigError(f"override {text!r}: '{'.'.join(path[:-1])}' is a list; use a number, not {part!r}") from None
    if not -len(node) <= idx < len(node):
        raise ConfigError(f"override {text!r}: index {idx} out of range for a list of {len(node)}")
    return idx
