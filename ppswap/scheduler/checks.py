"""Field checkers for option values, one definition each.

``ScheduleConfig`` (``ppswap.scheduler.config``) and ``RunOptions`` (``ppswap.options``)
check their fields with these, so an option is refused in the same words whichever way it
came in. Each raises ``TypeError`` for a value of the wrong type and ``ValueError`` for
one out of range, naming the parameter, the value and what is allowed.
"""

from __future__ import annotations

__all__ = ["check_bool", "check_int", "check_one_of"]


def check_int(name: str, value: object, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    """``value`` is exactly a bool (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def check_one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """``value`` is one of the strings ``allowed``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
