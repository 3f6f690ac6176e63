"""Value checks shared by the typed configs: sizes with units, positive integers."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: str | int, name: str, allow_zero: bool = False) -> int:
    """'2GiB', '512MB', '1e9' or an int -> bytes; 0 only with `allow_zero` (a size that means off)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a size like '2GiB' or '512MB', got {value!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 0 or (size == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'0 or more' if allow_zero else 'positive'}, got {value!r}")
    return size


def positive(name: str, value: int | None, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
