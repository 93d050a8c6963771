"""The point-to-point tags of a multi-process transport (``MPITransport``,
``TorchDistTransport``): one pair of tags per message key, a fresh range of them per run.

A run (an *epoch*, begun by :meth:`P2PTagLayout.configure`) needs ``4 * num_stages *
micro_count`` tags of the transport's ``tag_count``: for each of the ``2 * num_stages *
micro_count`` keys (F and B, every stage and micro-batch) an even tag for the header and
the next, odd one for the body. While the tag space holds more than one such layout,
consecutive epochs take disjoint ranges (``epoch % slots``), so that a message left over
from an earlier run never matches a receive of this one: not the header, whose epoch
would catch it, and not the body, which carries no epoch (a body whose receive was
cancelled after its header had arrived would otherwise be taken for this run's body).
"""

from __future__ import annotations

from ppswap.core.messages import MessageKey
from ppswap.core.rank_args import check_int, check_message_key
from ppswap.core.wire import p2p_identity

__all__ = ["DEFAULT_MICRO_COUNT", "P2PTagLayout"]

DEFAULT_MICRO_COUNT = 1 << 16
"""The layout before the first ``configure``: as many stages as fit with this many
micro-batches."""


class P2PTagLayout:
    """The tags of ``tag_count`` (tags ``[0, tag_count)``) for the current epoch (module
    docstring). ``tag_name`` names the tags in errors (``"MPI tags"``)."""

    def __init__(self, tag_count: int, tag_name: str = "tags") -> None:
        self.tag_count = tag_count
        self.tag_name = tag_name
        self.num_stages = max(1, tag_count // (4 * DEFAULT_MICRO_COUNT))
        self.micro_count = DEFAULT_MICRO_COUNT
        self.epoch = 0
        self._slots = 1  # disjoint ranges that consecutive epochs rotate through
        self._addresses: dict[MessageKey, tuple[int, int]] = {}

    def configure(self, num_stages: int, micro_count: int) -> None:
        """Start a new epoch with this layout. ValueError when ``4 * num_stages *
        micro_count`` tags exceed ``tag_count``."""
        check_int("num_stages", num_stages, 1, self.tag_count + 1)
        check_int("micro_count", micro_count, 1, self.tag_count + 1)
        needed = 4 * num_stages * micro_count
        if needed > self.tag_count:
            raise ValueError(
                f"num_stages={num_stages} and micro_count={micro_count} need {needed} "
                f"{self.tag_name}; at most {self.tag_count} allowed"
            )
        self.num_stages, self.micro_count = num_stages, micro_count
        self._slots = self.tag_count // needed
        self._addresses.clear()
        self.epoch += 1

    def address(self, key: MessageKey) -> tuple[int, int]:
        """``(header tag, identity)`` of ``key`` in this epoch (the key validated once; the
        body's tag is the header's + 1)."""
        if not isinstance(key, MessageKey):
            raise TypeError(f"key must be a MessageKey, got {key!r}")
        address = self._addresses.get(key)
        if address is None:
            check_message_key(key, self.num_stages, self.micro_count)
            keys_per_epoch = 2 * self.num_stages * self.micro_count
            slot = self.epoch % self._slots
            tag = 2 * (slot * keys_per_epoch + key.tag(self.num_stages, self.micro_count))
            address = self._addresses[key] = (tag, p2p_identity(key))
        return address
