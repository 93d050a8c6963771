"""SwapAccounting: blocks count once however many holders they have; the batched calls
(``hold_all``, ``drop_all``) keep exactly the books the one-holder calls keep."""

from __future__ import annotations

import pytest

from ppswap.swap.accounting import SwapAccounting


def test_a_block_counts_once_until_its_last_holder_drops_it() -> None:
    books = SwapAccounting()
    books.hold(("storage", 1), 100, "a", (0, 0))
    books.hold(("storage", 1), 100, "b", (0, 1))
    assert books.resident_bytes == 100
    books.drop(("storage", 1), "a")
    assert books.resident_bytes == 100
    assert books.held_by_other_chunk(("storage", 1), (0, 0))
    assert not books.held_by_other_chunk(("storage", 1), (0, 1))
    books.drop(("storage", 1), "b")
    assert books.resident_bytes == 0
    assert books.peak_bytes == 100
    assert not books.held_by_other_chunk(("storage", 1), (0, 0))


def test_batched_calls_keep_the_same_books_as_one_holder_at_a_time() -> None:
    one, batched = SwapAccounting(), SwapAccounting()
    holders = ["e0", "e1", "e2"]
    for holder in holders:
        one.hold(("loaded", 7), 64, holder, (1, 2))
    one.hold(("storage", 9), 32, "e3", (1, 2))
    batched.hold_all(("loaded", 7), 64, holders, (1, 2))
    batched.hold(("storage", 9), 32, "e3", (1, 2))
    assert (one.resident_bytes, one.peak_bytes) == (batched.resident_bytes, batched.peak_bytes)
    assert one.chunks_holding(("loaded", 7)) == batched.chunks_holding(("loaded", 7))

    pairs = [(("loaded", 7), "e0"), (("loaded", 7), "e1"), (("storage", 9), "e3")]
    for block, holder in pairs:
        one.drop(block, holder)
    batched.drop_all(pairs)
    assert one.resident_bytes == batched.resident_bytes == 64  # e2 still holds block 7
    batched.drop_all([(("loaded", 7), "e2"), (("loaded", 7), "e2"), (("loaded", 99), "x")])
    assert batched.resident_bytes == 0  # unknown and repeated pairs are ignored
    assert batched.block_count == 0


def test_hold_all_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        SwapAccounting().hold_all(("loaded", 1), -1, ["e"], (0, 0))
