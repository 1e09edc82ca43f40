"""Sizes with units on the command line and in configs: 64MiB, 1GiB, 1.5GB, 4096."""

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in `text`; raises ValueError naming the bad input."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 1GiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Short binary form for tables: 1.5GiB, 64KiB, 12B."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" or value == int(value) else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
