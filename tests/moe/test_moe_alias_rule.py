"""The alias rule of expert parallelism: a buffer an all-to-all owns (the rows it sends,
the rows it delivers) is never one swap moves. The MoE blocks send host copies made when
an exchange is posted and compute on copies of what it delivered
(``ppswap.core.expert_routing.exchange_rows``), so no saved tensor, hence no swap
entry, shares memory with an exchange's buffers, in flight or after.

Checked on a real run (torch, pp2 x dp2 x ep2, every rank in this process, swap on):
the transport keeps every array an all-to-all sends or delivers alive for the run (so
no address is reused) and records which are in flight; the copy engine checks each
offload's source bytes against all of them, and each exchange posted during an offload
against the bytes being copied. A peer held back at its forwards keeps exchanges in
flight, and the copy engine's bandwidth floor keeps offloads going, so the check meets
offloads made during exchanges and exchanges posted during offloads. The negative
control hands the engine a saved tensor that *is* an exchange's buffer (a block that
would compute on the delivered rows in place), and the check catches it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from ppswap import run_schedule
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.core.faults import FaultPlan, delay_compute
from ppswap.fsdp import DeviceMesh
from ppswap.scheduler.steps import StepKind
from ppswap.transports.inprocess import InProcessTransport

torch = pytest.importorskip("torch")

from moe_support import ep_stages, make_data, mse_loss  # noqa: E402

Span = tuple[int, int]  # [start, end) addresses


def _span(array: np.ndarray) -> Span:
    low, high = np.byte_bounds(array)
    return low, high


def _overlaps(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


class BufferLedger:
    """Every array the all-to-alls sent or delivered (kept alive), those in flight, and
    what the copy engine offloaded against them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: list[np.ndarray] = []
        self.spans: list[Span] = []
        self.in_flight: dict[int, list[Span]] = {}
        self.copying: dict[int, list[Span]] = {}
        self.exchanges = 0
        self.offloads = 0
        self.overlapped = 0  # an exchange and an offload were in progress together
        self.violations: list[str] = []

    def posted(self, call: int, arrays: Sequence[np.ndarray]) -> None:
        with self.lock:
            self.exchanges += 1
            self.kept.extend(arrays)
            spans = [_span(a) for a in arrays]
            self.spans.extend(spans)
            self.in_flight[call] = spans
            copying = [span for spans in self.copying.values() for span in spans]
            if copying:
                self.overlapped += 1
            for mine in spans:
                if any(_overlaps(mine, span) for span in copying):
                    self.violations.append(f"exchange of {mine} while it is offloaded")

    def delivered(self, call: int, arrays: Sequence[np.ndarray]) -> None:
        with self.lock:
            self.in_flight.pop(call, None)
            self.kept.extend(arrays)
            self.spans.extend(_span(a) for a in arrays)

    def offloading(self, copy: int, sources: Sequence[np.ndarray]) -> None:
        with self.lock:
            self.offloads += len(sources)
            flying = [span for spans in self.in_flight.values() for span in spans]
            if flying:
                self.overlapped += 1
            spans = [_span(source) for source in sources]
            self.copying[copy] = spans
            for mine in spans:
                if any(_overlaps(mine, span) for span in self.spans):
                    in_flight = any(_overlaps(mine, span) for span in flying)
                    self.violations.append(f"offload of {mine} (in flight: {in_flight})")

    def offloaded(self, copy: int) -> None:
        with self.lock:
            self.copying.pop(copy, None)


class LedgerTransport(InProcessTransport):
    """The in-process transport, recording each all-to-all's buffers in ``ledger``."""

    def __init__(self, ledger: BufferLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self._calls = 0

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[Any]
    ) -> list[Any]:
        self._calls += 1
        call = self._calls
        self.ledger.posted(call, arrays)
        received = await super().all_to_all(rank, group, key, arrays)
        self.ledger.delivered(call, received)
        return received


class LedgerEngine(EmulatedDevice):
    """The CPU copy engine, checking each offload's sources against ``ledger`` (and the
    exchanges posted while it copies them), with a bandwidth floor that makes each
    offload last a while."""

    def __init__(self, ledger: BufferLedger, d2h_gbps: float | None = None) -> None:
        super().__init__(d2h_gbps=d2h_gbps)
        self.ledger = ledger

    def d2h_many(self, sources: Sequence[Any], into: Any = None) -> list[Any]:
        copy = id(sources)
        self.ledger.offloading(copy, sources)
        try:
            return super().d2h_many(sources, into)
        finally:
            self.ledger.offloaded(copy)


@pytest.mark.asyncio
async def test_no_offload_touches_a_buffer_an_all_to_all_owns() -> None:
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    micro = 8
    stages = ep_stages(2, mesh, 2)
    ledger = BufferLedger()
    # Rank 2 (rank 0's EP peer) is late at each forward: rank 0's exchanges stay in
    # flight while its copy thread offloads the chunks before.
    plan = FaultPlan(
        tuple(delay_compute(0.05, StepKind.FWD, rank=2, stage=0, micro=m) for m in range(micro))
    )
    x, y = make_data(mesh.dp * micro * 2)
    result = await run_schedule(
        stages,
        "gpipe",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
        transport=LedgerTransport(ledger),
        device=LedgerEngine(ledger, d2h_gbps=1e-3),  # a chunk's KBs: milliseconds
        faults=plan,
        step_timeout=60.0,
    )
    assert sum(r.offloaded_bytes for r in result.ranks) > 0
    assert ledger.exchanges >= 2 * 2 * micro * 5  # per rank and chunk: 3 forward, 2 backward
    assert ledger.overlapped > 0, (ledger.offloads, ledger.overlapped)
    assert ledger.violations == []


def test_the_check_catches_an_offload_of_an_exchange_buffer() -> None:
    """Negative control: a saved tensor computed in place on the delivered rows (what a
    block that skipped the copy would save) is an exchange's buffer; its offload is
    caught, in flight and after."""
    ledger = BufferLedger()
    sent = [np.arange(12, dtype=np.float32), np.zeros(0, dtype=np.float32)]
    ledger.posted(1, sent)
    engine = LedgerEngine(ledger)
    engine.d2h_many([sent[0].view(np.uint8)[8:24]])
    assert ledger.overlapped == 1
    delivered = [np.ones(6, dtype=np.float32)]
    ledger.delivered(1, delivered)
    saved = torch.from_numpy(delivered[0])  # the rows, not a copy of them
    engine.d2h_many([saved.numpy().view(np.uint8)])
    assert ledger.violations[0].endswith("(in flight: True)")
    assert ledger.violations[1].endswith("(in flight: False)")
    assert len(ledger.violations) == 2
    engine.d2h_many([saved.clone().numpy().view(np.uint8)])  # a copy is not
    assert len(ledger.violations) == 2
