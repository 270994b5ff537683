"""Reading one field of a DDPJob's spec: `SpecError` (the one error of the parsers, naming the field) and the readers
of an object, an integer and a boolean that spec.py and diagnostics.py share. Pure."""

from __future__ import annotations

from typing import Mapping


class SpecError(ValueError):
    """A DDPJob that cannot be run as written. `field` is the JSON path of the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def section(spec: Mapping, key: str, path: str | None = None) -> Mapping:
    """`spec[key]`, an object; {} when absent or null."""
    value = spec.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(path or f"spec.{key}", "must be an object")
    return value


def integer(section_: Mapping, key: str, path: str, *, default: int | None = None, minimum: int = 0,
            maximum: int | None = None) -> int | None:
    value = section_.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(path, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be <= {maximum}, got {value}")
    return value


def boolean(section_: Mapping, key: str, path: str, *, default: bool) -> bool:
    value = section_.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, got {value!r}")
    return value

