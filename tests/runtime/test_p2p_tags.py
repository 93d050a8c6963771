"""The point-to-point tag layout both multi-process transports use (``core/p2p_tags.py``):
distinct tags within a run, disjoint ranges for consecutive runs while the tags have
room, bad layouts and keys refused with their names."""

from __future__ import annotations

import pytest

from ppswap.core.messages import MessageKey
from ppswap.core.p2p_tags import P2PTagLayout


def all_keys(stages: int, micros: int) -> list[MessageKey]:
    return [MessageKey(d, s, m) for d in "FB" for s in range(stages) for m in range(micros)]


def used_tags(layout: P2PTagLayout, keys: list[MessageKey]) -> set[int]:
    """Every header tag and its body's (header + 1)."""
    headers = [layout.address(key)[0] for key in keys]
    assert all(tag % 2 == 0 for tag in headers)
    return set(headers) | {tag + 1 for tag in headers}


def test_a_run_uses_distinct_tags_and_the_next_run_others() -> None:
    layout = P2PTagLayout(tag_count=1 << 12)
    keys = all_keys(4, 8)
    layout.configure(num_stages=4, micro_count=8)
    first = used_tags(layout, keys)
    assert len(first) == 2 * len(keys) and max(first) < layout.tag_count
    identities = [layout.address(key)[1] for key in keys]
    layout.configure(num_stages=4, micro_count=8)
    second = used_tags(layout, keys)
    assert len(second) == 2 * len(keys) and not first & second
    assert [layout.address(key)[1] for key in keys] == identities  # the key's, every run
    assert layout.epoch == 2


def test_a_layout_that_fills_the_tags_reuses_them_every_run() -> None:
    layout = P2PTagLayout(tag_count=4 * 3 * 5)
    keys = all_keys(3, 5)
    layout.configure(num_stages=3, micro_count=5)
    first = used_tags(layout, keys)
    layout.configure(num_stages=3, micro_count=5)
    assert used_tags(layout, keys) == first == set(range(layout.tag_count))


def test_bad_layouts_and_keys_are_refused_by_name() -> None:
    layout = P2PTagLayout(tag_count=1 << 10, tag_name="MPI tags")
    with pytest.raises(ValueError, match="num_stages=16 and micro_count=32 need 2048 MPI tags"):
        layout.configure(num_stages=16, micro_count=32)
    with pytest.raises(ValueError, match="num_stages=0 out of range"):
        layout.configure(num_stages=0, micro_count=1)
    assert layout.epoch == 0  # nothing changed
    layout.configure(num_stages=2, micro_count=4)
    with pytest.raises(ValueError, match=r"key\.micro=4 out of range"):
        layout.address(MessageKey("F", 1, 4))
    with pytest.raises(ValueError, match=r"key\.direction='X'"):
        layout.address(MessageKey("X", 0, 0))
    with pytest.raises(TypeError, match="key must be a MessageKey"):
        layout.address(("F", 0, 0))  # type: ignore[arg-type]
