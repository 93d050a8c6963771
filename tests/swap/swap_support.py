"""Test support for the swap runtime: a real copy thread, small models, gradient checks."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import CopyJob, EmulatedDevice, PipelineSwapSession

Grads = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]


class CopyThread:
    """A real copy thread running CopyJobs FIFO, as the runtime's copy stream does.

    ``submit`` returns at once; jobs run on this thread in submission order. Exceptions
    raised by jobs are collected in ``errors`` (the job also keeps its own ``error``).
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[CopyJob | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.ran: list[CopyJob] = []
        self._thread = threading.Thread(target=self._loop, name="swap-copy-test")
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.run()
            except BaseException as exc:
                self.errors.append(exc)
            self.ran.append(job)

    def submit(self, job: CopyJob) -> CopyJob:
        self._jobs.put(job)
        return job

    def run_now(self, job: CopyJob, timeout_s: float = 10.0) -> CopyJob:
        """Submit and wait until the job is done."""
        self.submit(job)
        assert job.done.wait(timeout_s), f"copy job did not finish in {timeout_s} s: {job!r}"
        return job

    def close(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "copy thread did not stop"


def full_round_trip(
    session: PipelineSwapSession, stage: int, micro: int, copy: CopyThread
) -> tuple[int, int]:
    """Offload then load one chunk through the copy thread; return (released, restored)."""
    copy.run_now(session.prepare_offload(stage, micro))
    released = session.finish_offload(stage, micro)
    copy.run_now(session.prepare_load(stage, micro))
    restored = session.finish_load(stage, micro)
    return released, restored


def seeded(shape: Sequence[int], seed: int, scale: float = 1.0) -> Tensor:
    rng = np.random.default_rng(seed)
    return Tensor((rng.standard_normal(tuple(shape)) * scale).astype(np.float32))


class MLP(nn.Cell):
    """Residual MLP blocks; each block is a Cell that can be swap-wrapped."""

    def __init__(self, dim: int = 16, hidden: int = 32, blocks: int = 3, seed: int = 0) -> None:
        super().__init__()
        cells = []
        for i in range(blocks):
            block = nn.SequentialCell(nn.Dense(dim, hidden), nn.GELU(), nn.Dense(hidden, dim))
            for j, param in enumerate(block.trainable_params()):
                param.set_data(seeded(param.shape, seed * 100 + i * 10 + j, 0.3))
            cells.append(block)
        self.layers = nn.CellList(cells)

    def construct(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = ops.tanh(layer(x)) + x
        return x


class Attention(nn.Cell):
    """A small self-attention block: layernorm, matmul, transpose, softmax."""

    def __init__(self, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((dim,))
        self.wq = Parameter(seeded((dim, dim), seed + 1, 0.3), name="wq")
        self.wk = Parameter(seeded((dim, dim), seed + 2, 0.3), name="wk")
        self.wv = Parameter(seeded((dim, dim), seed + 3, 0.3), name="wv")
        self.wo = Parameter(seeded((dim, dim), seed + 4, 0.3), name="wo")
        self.scale = 1.0 / float(np.sqrt(dim))

    def construct(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        q = ops.matmul(h, self.wq)
        k = ops.matmul(h, self.wk)
        v = ops.matmul(h, self.wv)
        scores = ops.matmul(q, k.transpose(0, 2, 1)) * self.scale
        attn = ops.softmax(scores, axis=-1)
        return x + ops.matmul(ops.matmul(attn, v), self.wo)


class AttentionStack(nn.Cell):
    def __init__(self, dim: int = 16, blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.CellList([Attention(dim, seed + 10 * i) for i in range(blocks)])

    def construct(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def loss_of(model: nn.Cell) -> Callable[[Tensor], Tensor]:
    def fn(x: Tensor) -> Tensor:
        out: Tensor = model(x)
        return (out * out).mean()

    return fn


def forward(
    fn: Callable[..., Tensor], x: Tensor, params: Sequence[Parameter]
) -> tuple[Tensor, Callable[[Tensor], Grads]]:
    out, vjp_fn = ms.vjp(fn, x, weights=list(params))
    return out, vjp_fn


def backward(vjp_fn: Callable[[Tensor], Grads]) -> list[np.ndarray]:
    dx, dw = vjp_fn(Tensor(1.0, ms.float32))
    return [g.asnumpy().copy() for g in (*dx, *dw)]


def release_forward(vjp_fn: Callable[[Tensor], Grads]) -> None:
    """Give back a recorded forward whose gradients the test does not need.

    ``ms.vjp`` keeps its forward recorded in MindSpore's executor until ``vjp_fn`` runs;
    this runs it with a zero sensitivity (every forward here returns a scalar loss), as
    ``MindSporeAutograd.release`` does for the runtime's records. The backward may
    raise (say, its swap group was already released or aborted): the record is consumed
    all the same, so the error is of no interest here.
    """
    with contextlib.suppress(Exception):
        vjp_fn(Tensor(0.0, ms.float32))


def reference_grads(
    fn: Callable[..., Tensor], x: Tensor, params: Sequence[Parameter]
) -> list[np.ndarray]:
    _, vjp_fn = forward(fn, x, params)
    return backward(vjp_fn)


def assert_bit_identical(expected: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert a.tobytes() == b.tobytes(), f"gradient {i} differs (max |d|={np.abs(a - b).max()})"


def address_reused(ptr: int, shape: tuple[int, ...], tries: int = 16) -> bool:
    """Whether MindSpore hands out the memory at ``ptr`` again for a same-size tensor.

    A live storage can never be handed out twice, so reuse proves the storage at ``ptr``
    was freed. (No reuse within ``tries`` allocations proves nothing by itself; tests pair
    this with a control in which a reference is deliberately kept.)
    """
    allocated: list[Any] = []
    for _ in range(tries):
        t = ops.zeros(shape, ms.float32)
        t.asnumpy()
        allocated.append(t)
        if t.untyped_storage().data_ptr() == ptr:
            return True
    return False


def settle_allocator(shape: tuple[int, ...], count: int = 4) -> None:
    """Allocate and free a few tensors of ``shape`` before a test captures one.

    Measured on mindspore 2.10 CPU: in a fresh process the first block of a size is not
    handed out again by the next allocations of that size even once it is freed, so an
    ``address_reused`` probe on it reports "not freed" (the storage was freed). Once
    blocks of the size have been allocated and freed, a freed one is reused at once. This
    cannot make a live storage look freed: the controls still see no reuse.
    """
    tensors = [ops.zeros(shape, ms.float32) for _ in range(count)]
    for t in tensors:
        t.asnumpy()
    del tensors


class ForwardLedger:
    """The forwards a test recorded through ``mindspore.vjp``, and which are still pending.

    ``ms.vjp`` records its forward in MindSpore's PyNative executor, and the record stays
    there until the returned ``vjp_fn`` runs (a backward that raises consumes it too). A
    forward whose ``vjp_fn`` never runs, or one that raised inside ``ms.vjp`` (its graph is
    never closed), is left behind; two such leftovers make a later backward, in any test,
    fail with "Can not find top cell for backward". ``vjp`` is a drop-in replacement for
    ``mindspore.vjp`` that keeps this ledger (tests/swap/conftest.py installs it).
    """

    def __init__(self, vjp: Callable[..., Any]) -> None:
        self._vjp = vjp
        self._pending: dict[int, tuple[str, Callable[..., Any]]] = {}
        self._serial = 0
        self.raised: list[str] = []

    def vjp(self, fn: Callable[..., Any], *inputs: Any, **kwargs: Any) -> Any:
        label = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            result = self._vjp(fn, *inputs, **kwargs)
        except BaseException:
            self.raised.append(label)
            raise
        self._serial += 1
        serial, vjp_fn = self._serial, result[1]

        def tracked(*sens: Any) -> Any:
            self._pending.pop(serial, None)
            return vjp_fn(*sens)

        self._pending[serial] = (label, tracked)
        return (result[0], tracked, *result[2:])

    @property
    def pending(self) -> list[str]:
        """The forwards recorded and never backwarded (``vjp_fn`` never called)."""
        return [label for label, _ in self._pending.values()]

    def discard(self) -> None:
        """Drop every record of the executor without running a backward (for a forward
        whose backward cannot run, say its saved storage was freed under it: MindSpore
        would read freed memory). Values the hooks packed may stay alive (see
        ``ppswap.backends.mindspore.autograd``); in a test that is a few bytes."""
        self._pending.clear()
        self.raised.clear()
        MINDSPORE.autograd.discard_all()

    def clean_up(self) -> None:
        """Leave the executor with nothing recorded: release every pending forward (a
        zero-sensitivity backward, newest first, as ``ms.vjp`` needs), then discard what
        is left, the open graphs of forwards that raised included."""
        for _, vjp_fn in reversed(list(self._pending.values())):
            release_forward(vjp_fn)
        self.discard()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.0005)


class GatedDevice(EmulatedDevice):
    """An EmulatedDevice whose copies wait for a gate: a copy "in flight" for as long as a
    test needs, deterministically (no timing assumptions).

    ``d2h_gate`` / ``h2d_gate`` start open; ``clear()`` one to hold the copies of that
    direction at their start, ``set()`` it (or ``open_later``) to let them run.
    """

    def __init__(self, gate_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.d2h_gate = threading.Event()
        self.h2d_gate = threading.Event()
        self.d2h_gate.set()
        self.h2d_gate.set()
        self._gate_timeout_s = gate_timeout_s

    def _pass(self, gate: threading.Event) -> None:
        if not gate.wait(self._gate_timeout_s):
            raise AssertionError("a gated copy was never released by the test")

    def d2h_many(self, sources: Any, into: Any = None) -> Any:
        self._pass(self.d2h_gate)
        return super().d2h_many(sources, into)

    def h2d(self, host: Any, strides: Any = None, dtype: str | None = None) -> Any:
        self._pass(self.h2d_gate)
        return super().h2d(host, strides, dtype)

    def h2d_block(self, hosts: Any, offsets: Any, nbytes: int) -> Any:
        self._pass(self.h2d_gate)
        return super().h2d_block(hosts, offsets, nbytes)


def open_later(gate: threading.Event, delay_s: float = 0.1) -> threading.Timer:
    """Open ``gate`` from another thread after ``delay_s`` (while this one blocks)."""
    timer = threading.Timer(delay_s, gate.set)
    timer.start()
    return timer
