"""Tensor-framework backends, chosen from the objects they are given.

``backend_for(module)`` returns the backend of a stage's module (or of a tensor): the
framework is read from the module path of the object's class and its bases
(``mindspore.*`` or ``torch.*``), and only then is that backend, and with it its
framework, imported. Anything else is refused with a ``TypeError`` naming its type.
Importing this package imports no framework.
"""

from __future__ import annotations

import importlib

from ppswap.backends.base import Backend

__all__ = ["BACKENDS", "Backend", "backend_for", "backend_named", "framework_of", "type_name"]

BACKENDS: dict[str, str] = {
    "mindspore": "ppswap.backends.mindspore",
    "torch": "ppswap.backends.torch",
}
"""Framework name (the top-level package of its classes) -> the backend's module."""


def framework_of(obj: object) -> str | None:
    """The framework whose class (or a base class) ``obj`` is an instance of, or None."""
    for cls in type(obj).__mro__:
        root = cls.__module__.partition(".")[0]
        if root in BACKENDS:
            return root
    return None


def backend_named(name: str) -> Backend:
    """The backend of framework ``name`` (imports the framework)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    backend: Backend = importlib.import_module(BACKENDS[name]).BACKEND
    return backend


def backend_for(
    obj: object, what: str = "module", expected: str = "a mindspore.nn.Cell or a torch.nn.Module"
) -> Backend:
    """The backend of ``obj``'s framework; a ``TypeError`` naming ``what``, what was
    ``expected`` and the type of ``obj`` when it belongs to none."""
    name = framework_of(obj)
    if name is None:
        raise TypeError(f"{what} must be {expected}, got {type_name(obj)}")
    return backend_named(name)


def type_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s type, for error messages."""
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"
