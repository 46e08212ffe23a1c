"""Numbers read from environment variables: one parse, one check, one clear error."""
from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T", int, float)


def env_number(name: str, default: T, parse: Callable[[str], T], valid: Callable[[T], bool], expected: str,
               error: type[Exception] = ValueError) -> T:
    """$name parsed with `parse` (unset or blank: `default`); a value that does not parse or fails
    `valid` raises `error` naming the variable, its value and `expected`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise error(f"{name}={raw!r}: expected {expected}") from None
    if not valid(value):
        raise error(f"{name}={raw!r}: expected {expected}")
    return value
