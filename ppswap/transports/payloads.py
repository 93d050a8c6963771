"""Payloads between stages: one tensor, or a tuple of them (``(hidden, mask)``).

A stage may hand the next one several tensors: its module returns a tuple, and the next
stage's module is called with them as positional arguments; the backward sends back one
gradient per tensor, None where there is none (an integer mask, an input nobody
differentiated). Between ranks of one process a tuple travels as a tuple of payloads;
between processes the transport packs it into one array (``core.wire.wire_array``,
``core.packed``), which arrives here packed and is unpacked into views of the received
buffer. A single tensor travels as itself, with no tuple around it.
"""

from __future__ import annotations

from typing import Any

from ppswap.backends.base import Backend
from ppswap.core.messages import Payload
from ppswap.core.packed import is_packed, unpack

__all__ = ["payload_nbytes", "payload_of", "tensors_of"]


def tensors_of(backend: Backend, payload: Payload, like: Any) -> Any:
    """The tensor (or tuple of tensors and None) a received ``payload`` carries, placed
    like ``like`` (``Backend.from_payload``)."""
    if isinstance(payload, tuple):
        return tuple(None if p is None else backend.from_payload(p, like) for p in payload)
    if is_packed(payload):
        return tuple(None if p is None else backend.from_payload(p, like) for p in unpack(payload))
    return backend.from_payload(payload, like)


def payload_of(backend: Backend, value: Any, *, copy: bool, host: bool) -> Payload:
    """``value`` (a tensor, or a tuple of tensors and None) as a payload
    (``Backend.to_payload`` for each tensor)."""
    if isinstance(value, tuple):
        return tuple(
            None if v is None else backend.to_payload(v, copy=copy, host=host) for v in value
        )
    return backend.to_payload(value, copy=copy, host=host)


def payload_nbytes(payload: Payload) -> int:
    """The bytes a payload carries (a tuple's: its elements')."""
    if isinstance(payload, tuple):
        return sum(0 if p is None else int(p.nbytes) for p in payload)
    return int(payload.nbytes)
