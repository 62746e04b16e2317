"""Config files and `--set` overrides: YAML read into a tree, `dotted.key=value` applied to it,
and a tree as dotted fields."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from relay.config.base import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=0.05` → (["optim", "lr"], 0.05); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc})") from None
    return key.strip().split("."), value


def set_dotted(data: dict[str, Any], path: list[str], value: Any) -> None:
    """`data[path[0]][path[1]]... = value`, creating sections on the way."""
    node = data
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise ConfigError(f"{where}: is not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as dotted fields: {"parallel": {"strategy": "ddp"}} → {"parallel.strategy":
    "ddp"} (the names `--set` takes); an empty section stays a field of its own."""
    fields: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            fields.update(flatten(value, f"{prefix}{key}."))
        else:
            fields[f"{prefix}{key}"] = value
    return fields


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        set_dotted(data, *parse_override(text))
    return data


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    return loaded
