"""Views of one storage move as one span (``ppswap/swap/spans.py``), on torch tensors.

torch saves views: ``q, k, v = qkv.unbind(0)`` gives three views of one storage at offsets
0, n and 2n (``bmm`` saves ``k`` transposed: strided), and ``tanh``'s output saved as it
is, flattened and transposed by a later ``mm`` is the same bytes three times. The swap
layer copies each storage's used bytes once, into one host block, and restores one device
block per storage with every view rebuilt into it: same shape, strides, offset (relative
to the span) and alignment, one shared storage, bit-identical gradients.

A chunk is collected in a real ``PipelineSwapSession`` (torch backend, CPU copy engine)
around ``TORCH.autograd.record``; its copy jobs run on the test's thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import nn

from ppswap.backends.autograd import ForwardRecord
from ppswap.backends.torch import BACKEND as TORCH
from ppswap.backends.torch.backend import TorchBackend
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapError, SwapManager, swap_wrapper
from ppswap.swap.spans import SPAN_ALIGNMENT, StorageSpan

BATCH, SEQ, DIM = 2, 4, 8


class SharedStorage(nn.Module):
    """Saves q, k transposed and v (views of one storage at offsets 0, n, 2n), and tanh's
    output three times: as it is, flattened and transposed (views of the same bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(x).reshape(batch, seq, 3, dim).permute(2, 0, 1, 3).contiguous()
        q, k, v = qkv.unbind(0)
        attn = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
        out = torch.bmm(attn, v)
        flat = torch.tanh(self.fc(out)).reshape(batch * seq, dim)
        gram = torch.mm(flat.t(), flat)
        return out.sum() + gram.pow(2).mean()


class Columns(nn.Module):
    """Saves columns 16..31 and 32..47 of a (rows, 64) activation: the span is the bytes
    from the first to the last used one, less than the storage."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.fc(x)
        return torch.sin(wide[:, 16:32]).sum() + torch.cos(wide[:, 32:48]).sum()


class _NoVersions(TorchBackend):
    """The torch backend without its version counter: the checks fall back on content
    digests, as on MindSpore."""

    def version_of(self, tensor: torch.Tensor) -> int | None:
        return None


@pytest.fixture
def engine() -> EmulatedDevice:
    return EmulatedDevice()


def _session(engine: EmulatedDevice, backend: TorchBackend = TORCH) -> PipelineSwapSession:
    return PipelineSwapSession(
        SwapManager(backend),
        engine,
        rank=0,
        generation=1,
        eligible={(0, 0)},
        wait_timeout_s=10.0,
        check="full",
    )


@pytest.fixture
def session(engine: EmulatedDevice) -> Iterator[PipelineSwapSession]:
    made = _session(engine)
    yield made
    made.abort()


def _seeded(module: nn.Module) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        for param in module.parameters():
            param.data.normal_(0.0, 0.4)
    return module


def _backward(record: ForwardRecord, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    dx, dw = TORCH.autograd.backward(record, torch.tensor(1.0), params)
    assert dx[0] is not None
    return [dx[0], *dw]


def _reference(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    _, record = TORCH.autograd.record(module, [x])
    return _backward(record, list(module.parameters()))


def _collect(session: PipelineSwapSession, module: nn.Module, x: torch.Tensor) -> ForwardRecord:
    params = list(module.parameters())
    with session.collection_context(0, 0, protected=[x], parameters=params):
        out, record = TORCH.autograd.record(module, [x])
    session.protect_aliases(0, 0, [out])
    return record


def _spans(session: PipelineSwapSession) -> tuple[StorageSpan, ...]:
    return session.manager.get_group(session.group_name(0, 0)).spans()


def _input(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(5))


def _assert_views_of_one_block(span: StorageSpan) -> None:
    """Every view of ``span`` is back as a view of one storage holding the span, at its
    offset in the span, with its shape, strides, dtype and address alignment."""
    restored = [entry.device for entry in span.entries]
    assert all(isinstance(t, torch.Tensor) for t in restored)
    storages = {t.untyped_storage().data_ptr() for t in restored}
    assert len(storages) == 1
    assert restored[0].untyped_storage().nbytes() == span.nbytes
    for (entry, offset), tensor in zip(span.members, restored, strict=True):
        key = entry.key
        assert tuple(tensor.shape) == key.shape and tuple(tensor.stride()) == key.strides
        assert str(tensor.dtype) == key.dtype
        assert tensor.storage_offset() * key.itemsize == offset
        assert offset == key.offset * key.itemsize - span.start
        original = key.storage_ptr + key.offset * key.itemsize
        assert tensor.data_ptr() % SPAN_ALIGNMENT == original % SPAN_ALIGNMENT


@pytest.mark.parametrize("group_swap", [False, True], ids=["per-span", "bucketed"])
def test_views_of_one_storage_move_once_and_come_back_as_views_of_one_block(
    session: PipelineSwapSession, engine: EmulatedDevice, group_swap: bool
) -> None:
    module = _seeded(swap_wrapper(SharedStorage(), group_swap=group_swap))
    x = _input(BATCH, SEQ, DIM)
    expected = _reference(module, x)
    record = _collect(session, module, x)

    spans = _spans(session)
    n = BATCH * SEQ * DIM * 4  # bytes of q, of k, of v
    qkv = next(s for s in spans if sorted(o for _, o in s.members) == [0, n, 2 * n])
    assert any(e.key.strides != (SEQ * DIM, DIM, 1) for e in qkv.entries)  # k transposed
    shared = next(s for s in spans if s is not qkv and len(s.members) == 3)
    assert [offset for _, offset in shared.members] == [0, 0, 0]  # tanh's, flat, flat.t()
    for span in spans:  # each span is its whole storage here
        device = span.entries[0].device
        assert span.start == 0 and span.nbytes == device.untyped_storage().nbytes()
    span_bytes = sum(s.nbytes for s in spans)
    view_bytes = sum(e.nbytes for s in spans for e in s.entries)
    assert span_bytes == view_bytes - 2 * shared.nbytes
    resident = session.stats().resident_saved_bytes
    before = engine.counters()

    job = session.prepare_offload(0, 0)
    assert job.nbytes == span_bytes
    job.run()
    session.finish_offload(0, 0)
    copied = engine.counters()
    assert copied.d2h_bytes - before.d2h_bytes == span_bytes
    assert copied.d2h_calls - before.d2h_calls == len(spans)  # one copy per storage
    host_blocks = {id(s.host_bucket) if group_swap else id(s.host) for s in spans}
    assert engine.pool_stats().lent == len(host_blocks) == (1 if group_swap else len(spans))
    assert all(s.host is not None and s.host.nbytes == s.nbytes for s in spans)
    assert session.stats().offloaded_bytes == span_bytes

    session.prepare_load(0, 0).run()
    assert session.finish_load(0, 0) == span_bytes
    loaded = engine.counters()
    assert loaded.h2d_calls - copied.h2d_calls == (1 if group_swap else len(spans))
    assert engine.block_stats().lent == 1  # the load's spans share one allocation
    for span in spans:
        _assert_views_of_one_block(span)
    stats = session.stats()
    assert stats.loaded_bytes == span_bytes and stats.resident_saved_bytes == resident

    got = _backward(record, list(module.parameters()))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)
    del record
    assert engine.pool_stats().lent == 0
    assert engine.block_stats().lent == 0  # and it is freed with the chunk


def test_a_backward_without_its_load_loads_each_span_once(
    session: PipelineSwapSession, engine: EmulatedDevice
) -> None:
    """The safety net (no load launched): the first view unpacked loads its whole span,
    and the other views of the storage are rebuilt into that same block."""
    module = _seeded(swap_wrapper(SharedStorage()))
    x = _input(BATCH, SEQ, DIM)
    expected = _reference(module, x)
    record = _collect(session, module, x)
    spans = _spans(session)
    session.prepare_offload(0, 0).run()
    session.finish_offload(0, 0)

    got = _backward(record, list(module.parameters()))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    assert session.stats().unpack_sync_loads == len(spans)
    for span in spans:
        _assert_views_of_one_block(span)
    assert session.prepare_load(0, 0).nbytes == 0
    session.release_chunk(0, 0)
    assert engine.pool_stats().lent == 0


def test_a_span_covers_only_the_bytes_its_views_use(
    session: PipelineSwapSession, engine: EmulatedDevice
) -> None:
    """Two column blocks of a wider activation: the span runs from the first used byte
    (rounded down to the 64-byte boundary) to the last, and the restored block is that
    size, so the device holds less than the storage it came from."""
    module = _seeded(swap_wrapper(Columns()))
    x = _input(6, DIM)
    expected = _reference(module, x)
    record = _collect(session, module, x)
    (span,) = _spans(session)
    storage_bytes = span.entries[0].device.untyped_storage().nbytes()
    assert storage_bytes == 6 * 64 * 4
    assert (span.start, span.nbytes) == (16 * 4, (5 * 64 + 48) * 4 - 16 * 4)
    assert [offset for _, offset in span.members] == [0, 16 * 4]
    resident = session.stats().resident_saved_bytes

    session.prepare_offload(0, 0).run()
    session.finish_offload(0, 0)
    session.prepare_load(0, 0).run()
    session.finish_load(0, 0)
    _assert_views_of_one_block(span)
    assert [e.device.storage_offset() for e in span.entries] == [0, 16]
    assert session.stats().resident_saved_bytes == resident - (storage_bytes - span.nbytes)
    assert session.stats().offloaded_bytes == span.nbytes

    got = _backward(record, list(module.parameters()))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("before the copy", "modified in place after capture"),
        ("after the copy", "modified in place after its copy"),
    ],
)
def test_a_write_through_one_view_is_seen_by_the_per_view_digests(
    engine: EmulatedDevice, when: str, message: str
) -> None:
    """Without a version counter the checks are the views' content digests, read out of
    the span's bytes: a write through one view of a shared storage is refused before the
    device memory is dropped, whether it came before or after the copy."""
    session = _session(engine, _NoVersions())
    try:
        module = _seeded(swap_wrapper(SharedStorage()))
        x = _input(BATCH, SEQ, DIM)
        _collect(session, module, x)
        shared = next(s for s in _spans(session) if [o for _, o in s.members] == [0, 0, 0])
        victim = shared.entries[-1].device
        job = session.prepare_offload(0, 0)
        if when == "before the copy":
            with torch.no_grad():
                victim[0, 0] += 1.0
            with pytest.raises(SwapError, match=message):
                job.run()
        else:
            job.run()
            with torch.no_grad():
                victim[0, 0] += 1.0
        with pytest.raises(SwapError, match=message):
            session.finish_offload(0, 0)
        assert all(e.device is not None for e in shared.entries)  # nothing dropped
    finally:
        session.abort()
