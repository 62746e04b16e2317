"""The config reference, generated from the field descriptions (docs/config-reference.md embeds
it; a test keeps the two in sync). `relay reference` prints it."""

from __future__ import annotations

import json
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from relay.config.run import RunConfig


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _optional_section(annotation) -> type[BaseModel] | None:
    """`Section | None`: the section's class."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    models = [
        a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)
    ]
    return models[0] if models else None


def _rows(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _rows(annotation, f"{prefix}{name}.")
            continue
        if section := _optional_section(annotation):  # a section that is off when null
            yield f"| `{prefix}{name}` | object \\| true \\| null | `null` | {field.description} |"
            yield from _rows(section, f"{prefix}{name}.")
            continue
        if field.default is PydanticUndefined and field.default_factory is None:
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = f"`{json.dumps(value)}`"
        yield f"| `{prefix}{name}` | {_type_name(annotation)} | {default} | {field.description} |"


def config_reference() -> str:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|", *_rows(RunConfig)]
    return "\n".join(lines) + "\n"
