"""Field checkers for option values, one definition each.

``ScheduleConfig`` (``ppswap.scheduler.config``) and ``RunOptions`` (``ppswap.options``)
check their fields with these, so an option is refused in the same words whichever way it
came in. Each raises ``TypeError`` for a value of the wrong type and ``ValueError`` for
one out of range, naming the parameter, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "budgets_per_rank",
    "check_bool",
    "check_int",
    "check_memory_budget",
    "check_one_of",
]


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


_BUDGET = "a positive int (bytes of saved activations per rank) or a mapping rank -> positive int"


def check_memory_budget(value: object, pp: int | None = None) -> None:
    """``value`` is a positive int or a mapping rank -> positive int; with ``pp`` known,
    the mapping holds exactly the ranks ``0 .. pp - 1``."""
    if isinstance(value, Mapping):
        for rank, nbytes in value.items():
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(f"memory_budget's keys must be ranks (ints), got {rank!r}")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int):
                raise TypeError(f"memory_budget[{rank}] must be {_BUDGET}, got {nbytes!r}")
            if nbytes <= 0:
                raise ValueError(f"memory_budget[{rank}] must be {_BUDGET}, got {nbytes!r}")
        if pp is None:
            return
        outside = sorted(rank for rank in value if not 0 <= rank < pp)
        if outside:
            raise ValueError(
                f"memory_budget names rank(s) {outside} outside the run's ranks 0..{pp - 1}"
            )
        missing = sorted(set(range(pp)) - set(value))
        if missing:
            raise ValueError(
                f"memory_budget must give every rank 0..{pp - 1} a budget, missing rank(s) "
                f"{missing}"
            )
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"memory_budget must be {_BUDGET}, got {value!r}")
    if value <= 0:
        raise ValueError(f"memory_budget must be {_BUDGET}, got {value!r}")


def budgets_per_rank(value: int | Mapping[int, int], pp: int) -> tuple[int, ...]:
    """A checked ``memory_budget`` as one budget per rank ``0 .. pp - 1``."""
    check_memory_budget(value, pp)
    if isinstance(value, Mapping):
        return tuple(value[rank] for rank in range(pp))
    return (value,) * pp
