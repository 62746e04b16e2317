"""What every part of the config shares: the error a bad config raises (naming its field), the
section base (unknown fields refused), names, and pydantic's errors as one line per field."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Names become directory names and URL path segments: letters, digits, '_', '.', '-'.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def name_field(default: str, what: str):
    return Field(
        default,
        pattern=NAME_PATTERN,
        max_length=64,
        description=f"{what} name prefix; the {what.lower()} id is `<name>-<timestamp>-<suffix>`.",
    )


def error_lines(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        # A section's own validator names the full field itself ("data.path: ...").
        named = not where or message.startswith(f"{where}.")
        lines.append(message if named else f"{where}: {message}")
    return lines
