"""Argument checks shared by the swap modules (TypeError/ValueError naming the argument)."""

from __future__ import annotations

import math

__all__ = ["check_bool", "check_int", "check_positive_seconds"]


def check_bool(name: str, value: object) -> bool:
    """``value`` must be exactly a bool (not 0/1, not None): else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` must be an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_positive_seconds(name: str, value: object) -> float:
    """``value`` must be a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)
