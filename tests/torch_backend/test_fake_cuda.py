"""The CUDA copy engine's code on CPU, with a fake device (``fake_cuda.py``) that holds
every copy back until its stream or event is synchronized and fills fresh memory with
junk: swap runs of every schedule family are bit-identical to swap off, and the engine
keeps its ordering contract (the D2H stream waits for the compute stream's event before a
chunk's first copy, every restored block is recorded on the compute stream, no page-locked
buffer is reused while a copy still uses it). One engine serves one device.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, FakeStream
from torch_support import Case, build_stages, grads_of, run_case

from ppswap import EmulatedDevice
from ppswap.backends.torch.backend import TorchBackend
from ppswap.backends.torch.cuda_engine import CudaCopyEngine

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=4, stage_num=4, micro=8),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4),
    Case("gpipe", pp=2, stage_num=2, micro=4, split_dw=True),
    Case("1f1b", pp=4, stage_num=4, micro=8, split_dw=True, overlap_b_f=True),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, overlap_b_f=True),
]


def _engine(fake: FakeCuda, device: str = "cuda:0") -> CudaCopyEngine:
    return CudaCopyEngine(torch.device(device), api=fake)


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=Case.label)
async def test_swap_through_the_cuda_engine_is_bit_identical(case: Case) -> None:
    """Every family (and the dx/dw split, real overlap) through ``CudaCopyEngine`` on the
    fake device: losses and gradients bit-identical to swap off, bytes really moved both
    ways, and no breach of the ordering contract."""
    base_stages = build_stages(case.stage_num)
    base = await run_case(base_stages, case, swap=False)
    fake = FakeCuda()
    engine = _engine(fake)
    swap_stages = build_stages(case.stage_num)
    swapped = await run_case(swap_stages, case, swap=True, device=engine)

    assert fake.violations == []
    assert fake.unrecorded_blocks() == 0
    assert swapped.losses == base.losses
    for stage_base, stage_swap in zip(grads_of(base_stages), grads_of(swap_stages), strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            assert torch.equal(g0, g1)
    moved = engine.counters()
    offloaded = sum(r.offloaded_bytes for r in swapped.ranks)
    assert offloaded > 0 and moved.d2h_bytes == moved.h2d_bytes == offloaded
    assert engine.pool_stats().lent == 0
    # every restored block was recorded on the compute stream
    assert any(entry[0] == "record_stream" for entry in fake.log)


def _activation(seed: int, n: int = 64) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.randn(n)


def test_the_d2h_stream_waits_for_the_chunks_event_before_its_first_copy() -> None:
    """A chunk's sources carry the event recorded on the compute stream when they were
    taken; the D2H stream waits for that very event before the chunk's first copy, even
    when later chunks recorded newer events meanwhile; one wait per chunk; the copy is
    complete when ``d2h_many`` returns (the host buffer holds the bytes, not junk)."""
    fake = FakeCuda()
    engine = _engine(fake).for_backend(TorchBackend())
    first, second = _activation(0), _activation(1)
    sources = engine.span_sources([(first, 0, 128), (first, 128, 128)])
    engine.span_sources([(second, 0, 256)])  # a later chunk's event
    ready = sources[0].ready
    assert sources[1].ready is ready

    hosts = engine.d2h_many(sources)

    assert fake.violations == []
    stream = engine.streams.of_this_thread("d2h")
    ordered = [e for e in fake.log if len(e) > 1 and e[1] is stream and e[0] in ("wait", "copy")]
    assert [e[0] for e in ordered] == ["wait", "copy", "copy"]
    assert ordered[0][2] is ready
    restored = np.concatenate(hosts).view(np.float32)
    np.testing.assert_array_equal(restored, first.numpy())
    for host in hosts:
        engine.release_host(host)


def test_loads_and_offloads_of_two_threads_use_streams_of_their_own() -> None:
    """A copy thread's D2H and H2D streams are its own (kept by thread name): a load on
    one thread never queues behind an offload on another's stream."""
    fake = FakeCuda()
    engine = _engine(fake).for_backend(TorchBackend())
    seen: dict[str, tuple[FakeStream, FakeStream]] = {}

    def note() -> None:
        name = threading.current_thread().name
        seen[name] = (engine.streams.of_this_thread("d2h"), engine.streams.of_this_thread("h2d"))

    threads = [threading.Thread(target=note, name=f"copy-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    streams = [s for pair in seen.values() for s in pair]
    assert len(streams) == len({id(s) for s in streams}) == 4
    note()  # the same thread name again: the same streams
    assert engine.streams.of_this_thread("d2h") is seen[threading.current_thread().name][0]


def test_a_load_is_complete_and_recorded_before_the_compute_stream_uses_it() -> None:
    """``h2d_block`` returns only once its copies ran (the block holds the bytes, not the
    device's junk), so its host buffers can go back to the pool; ``restore_views`` marks
    the block as used by the compute stream."""
    fake = FakeCuda()
    engine = _engine(fake).for_backend(TorchBackend())
    values = _activation(3)
    host = engine.acquire_host(values.numel() * 4)
    host[:] = values.numpy().view(np.uint8)
    (loaded,) = engine.h2d_block([host], [0], host.nbytes)
    engine.release_host(host)
    again = engine.acquire_host(host.nbytes)  # the same buffer, handed out again
    again[:] = 0
    (view,) = engine.restore_views(loaded, [(0, TorchBackend().view_key(values, _ref(values)))])
    assert torch.equal(view, values)
    assert fake.unrecorded_blocks() == 0
    assert fake.violations == []
    engine.release_host(again)


def _ref(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    return TorchBackend().storage_of(tensor)


def test_one_engine_moves_the_tensors_of_its_own_device_only() -> None:
    """A tensor on another GPU (or the host) is not the engine's to move, a source taken
    from one is refused, and swap with stages on two GPUs is refused in one line naming
    both."""
    fake = FakeCuda()
    engine = _engine(fake, "cuda:0").for_backend(TorchBackend())
    mine, other = _activation(0), _activation(1)
    fake.place(other, "cuda:1")
    assert engine.can_move(mine)
    assert not engine.can_move(other)
    with pytest.raises(ValueError, match=r"cannot move a tensor on cuda:1"):
        engine.span_sources([(other, 0, 64)])

    engine.check_devices(["cuda:0", "cuda:0", "cpu"])
    with pytest.raises(ValueError) as refused:
        engine.check_devices(["cuda:0", "cuda:1"])
    message = str(refused.value)
    assert "\n" not in message
    assert "(cuda:0, cuda:1)" in message and "several CUDA devices" in message
    with pytest.raises(ValueError, match=r"\(cuda:0, cuda:1\)"):
        _engine(fake, "cuda:1").check_devices(["cuda:0"])
    assert _engine(fake, "cuda").device == torch.device("cuda:0")
    with pytest.raises(ValueError, match="device must be a CUDA device, got cpu"):
        CudaCopyEngine(torch.device("cpu"), api=fake)


class _RefusingDevice(EmulatedDevice):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[str]] = []

    def check_devices(self, devices: list[str]) -> None:  # type: ignore[override]
        self.asked.append(list(devices))
        raise ValueError(f"refused {devices}")


@pytest.mark.asyncio
async def test_a_swap_run_asks_its_engine_about_the_stages_devices_before_any_work() -> None:
    """The runtime hands the engine every stage's device before the run starts (with
    swap; without, no copy is made and nothing is asked)."""
    case = Case("gpipe", pp=2, stage_num=2, micro=4)
    stages = build_stages(case.stage_num)
    device = _RefusingDevice()
    with pytest.raises(ValueError, match=r"refused \['cpu', 'cpu'\]"):
        await run_case(stages, case, swap=True, device=device)
    assert all(stage.generation == 0 for stage in stages)  # no run began
    await run_case(stages, case, swap=False, device=device)
    assert device.asked == [["cpu", "cpu"]]


def test_losses_are_kept_where_they_are_and_read_in_one_transfer() -> None:
    """``keep_scalar`` keeps a loss tensor (detached, on its device) and a host value as
    it is; ``host_floats`` gives each as ``float()`` would, in order, across dtypes."""
    backend = TorchBackend()
    weight = torch.tensor(3.0, requires_grad=True)
    loss = weight * 2
    kept = backend.keep_scalar(loss)
    assert isinstance(kept, torch.Tensor) and not kept.requires_grad
    values = [kept, np.float32(0.1), backend.keep_scalar(torch.tensor(0.3, dtype=torch.float16))]
    assert backend.host_floats(values) == [6.0, float(np.float32(0.1)), float(values[2])]
