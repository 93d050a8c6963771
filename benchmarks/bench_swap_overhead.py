"""Swap's own Python per chunk on torch, with the compute made negligible.

    python benchmarks/bench_swap_overhead.py [--sessions 25] [--repeats 7] [--model tiny|small]
    python benchmarks/bench_swap_overhead.py --sweep [--sizes 64K,160K,1M,8M,64M] [--pairs 5]

``--sweep`` instead measures a whole pipeline step with swap over the same step without,
on MindSpore and torch, by chunk size (``swap_sweep.py``: the model, the options and the
method; swap and no-swap runs alternating, medians of pairs, the process's CPU time too).

``bench_swap_check.py`` times swap beside a real chunk's compute, where run-to-run noise
on a shared 2-core machine is as large as a tenth of swap's cost, so a change that saves
a few percent of it cannot be seen there. This one keeps the graph and takes the compute
away: one stage of ``bench_torch_peer``'s model (four pre-norm MLP blocks, each
``swap_wrapper``-ed, so the same 40 saved tensors in 23 storages per chunk) at width 16
with one 4-token sequence per micro-batch. Each leaf then computes for microseconds, and
what is left per chunk is the framework's own overhead plus swap's bookkeeping.

Chunk after chunk runs through a real ``PipelineSwapSession`` on one thread: the forward
under the capture hooks, offload (``prepare_offload``, the copy job, ``finish_offload``),
load (likewise), backward, ``release_chunk``; four micro-batches per session, a fresh
session per round. Each phase is timed with ``time.thread_time`` with swap and with no
swap at all (no hooks), the two alternating, with the garbage collector off while timed
(a collection lands in whichever phase allocates, and would move tens of microseconds at
random). The copy jobs run inline here (in a pipeline they run on the copy thread), so the
"offload" and "load" rows include the copy jobs' Python too.

Reported: microseconds per chunk by phase, medians of ``--repeats`` rounds of
``--sessions`` sessions; what swap adds per chunk and per storage moved. Beside it, the
same chunk under the least a swap must do (``Chunks.floor``): saved-tensor hooks that keep
each saved tensor (and its version) in a list; when the forward ends, per saved tensor its
storage's identity and, once per storage that is not a parameter, a host byte view of it;
offload: each storage's bytes copied into a pooled host buffer, then every saved view of
it dropped; load: one block for the chunk, each storage copied in and its views rebuilt
on it (``as_strided``, each storage at a 64-byte boundary, as the swap layer places
them), the buffers given back; unpack returns the view. No checks, no states, no
accounting, no safety net: a lower bound, not a swap to use (each round checks, untimed,
that its first chunk's gradients equal the plain run's bit for bit). What the swap layer
adds beyond it is its own bookkeeping (docs/swap.md), and how far a leaner data model
could take it. Repeat runs on
the 2-core machine agree within about 10% (the no-swap figure moves with them: compare the
ratio too), against 20% or more for swap's share of a real chunk, so this is the figure
to compare when changing the swap layer's hot path.

``--model small`` runs the same stage at ``bench_torch_peer``'s own size (width 128, 8
sequences of 16 tokens per micro-batch, 2.5 MiB moved per chunk): what swap adds there
also holds what grows with the bytes (the copies, which run inline here; the pages glibc
returns once swap frees a storage and the next operations fault in again, docs/swap.md),
so it is not the figure for the swap layer's own Python.

``--contend-us B`` adds what a pipeline's other threads do to the compute thread: a thread
of the same process that sleeps ``--contend-period-us`` (GIL released, as the event loop
in ``epoll``), then runs ``B`` us of Python (GIL held, as the loop handling a message), for
as long as the chunks run. Every GIL release of the compute thread (each torch op, each
call of a saved-tensor hook from C++) then may hand the GIL over and wait to get it back.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import swap_sweep
import torch
from torch_peer_model import MODELS, Model, build_modules

from ppswap.backends.host_memory import HostPool
from ppswap.backends.torch import BACKEND as TORCH
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager, module_state_tensors
from ppswap.swap.transfer import aligned

TINY = Model(dim=16, blocks=8, micro=8, micro_batch=1, seq=4)
"""Two stages of four blocks; the second is measured (as ``bench_torch_peer`` at pp2)."""
SIZES = {"tiny": TINY, "small": MODELS["small"]}
STAGE = 1
MICROS_PER_SESSION = 4
PHASES = ("forward", "offload", "load", "backward", "release")


class Chunks:
    """The measured stage, its engine and inputs, kept across rounds (as a run keeps them)."""

    def __init__(self, model: Model = TINY) -> None:
        self.module = build_modules(model, 2, wrap=True)[STAGE]
        self.params = tuple(self.module.parameters())
        self.state = module_state_tensors(self.module)
        self.engine = EmulatedDevice()
        generator = torch.Generator().manual_seed(0)
        self.inputs = [
            torch.randn((model.micro_batch, model.seq, model.dim), generator=generator)
            for _ in range(MICROS_PER_SESSION)
        ]
        self.captured = 0
        self.storages = 0

    def run(self, swap: bool, sessions: int) -> dict[str, float]:
        """Microseconds per chunk by phase over ``sessions`` sessions."""
        totals = dict.fromkeys(PHASES, 0.0)
        for generation in range(sessions):
            eligible = {(STAGE, m) for m in range(MICROS_PER_SESSION)} if swap else set()
            session = PipelineSwapSession(
                SwapManager(TORCH),
                self.engine,
                rank=0,
                generation=generation,
                eligible=eligible,
                count_saved=swap,
            )
            for micro, x in enumerate(self.inputs):
                self._chunk(session, swap, micro, x, totals)
            session.close()
        chunks = sessions * MICROS_PER_SESSION
        return {phase: seconds / chunks * 1e6 for phase, seconds in totals.items()}

    def floor(self, micros: int) -> dict[str, float]:
        """Microseconds per chunk by phase under the least a swap must do (module doc)."""
        parameters = {TORCH.storage_of(t).ptr for t in self.state}
        pool = HostPool()
        totals = dict.fromkeys(PHASES, 0.0)
        saved: list[list[Any]] = []  # this chunk's handles

        def pack(tensor: torch.Tensor) -> list[Any]:
            handle = [tensor, tensor._version]
            saved.append(handle)
            return handle

        started = 0.0

        def lap(phase: str) -> None:
            nonlocal started
            now = time.thread_time()
            totals[phase] += now - started
            started = now

        for index in range(micros):
            x = self.inputs[index % MICROS_PER_SESSION]
            started = time.thread_time()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda handle: handle[0]):
                out, record = TORCH.autograd.record(self.module, (x,))
            storages: dict[int, tuple[Any, list[list[Any]]]] = {}
            for handle in saved:
                ptr, nbytes = TORCH.storage_of(handle[0])
                if ptr in parameters:
                    continue
                held = storages.get(ptr)
                if held is None:
                    storages[ptr] = (TORCH.host_bytes(handle[0], 0, nbytes), [handle])
                else:
                    held[1].append(handle)
            lap("forward")
            # each storage's bytes into a pooled buffer, then every view of it dropped
            moved: list[tuple[Any, list[tuple[list[Any], Any]]]] = []
            for source, handles in storages.values():
                host = pool.acquire(source.nbytes)
                np.copyto(host, source)
                views = []
                for handle in handles:
                    tensor = handle[0]
                    view = (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset())
                    views.append((handle, view))
                    handle[0] = None
                moved.append((host, views))
            storages.clear()
            lap("offload")
            # one block for the chunk, each storage copied in, each view rebuilt on it
            block = np.empty(sum(aligned(host.nbytes) for host, _ in moved), dtype=np.uint8)
            offset = 0
            for host, views in moved:
                end = offset + host.nbytes
                np.copyto(block[offset:end], host)
                base = torch.from_numpy(block[offset:end])
                for handle, (dtype, shape, stride, storage_offset) in views:
                    handle[0] = base.view(dtype).as_strided(shape, stride, storage_offset)
                pool.release(host)
                offset = aligned(end)
            moved.clear()
            lap("load")
            _, grads = TORCH.autograd.backward(record, torch.ones_like(out), self.params)
            lap("backward")
            saved.clear()
            lap("release")
            if index == 0:  # untimed: the floor restored every saved view's values
                self._check_floor(x, grads)
        return {phase: seconds / micros * 1e6 for phase, seconds in totals.items()}

    def _check_floor(self, x: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> None:
        """Raise unless ``grads`` are the plain run's for input ``x``, bit for bit."""
        out, record = TORCH.autograd.record(self.module, (x,))
        _, want = TORCH.autograd.backward(record, torch.ones_like(out), self.params)
        if not all(torch.equal(a, b) for a, b in zip(grads, want, strict=True)):
            raise RuntimeError("the floor's gradients differ from the plain run's")

    def _chunk(
        self,
        session: PipelineSwapSession,
        swap: bool,
        micro: int,
        x: torch.Tensor,
        totals: dict[str, float],
    ) -> None:
        started = time.thread_time()

        def lap(phase: str) -> None:
            nonlocal started
            now = time.thread_time()
            totals[phase] += now - started
            started = now

        with session.collection_context(STAGE, micro, protected=(x,), parameters=self.state):
            out, record = TORCH.autograd.record(self.module, (x,))
        lap("forward")
        for phase, launch, wait in (
            ("offload", session.prepare_offload, session.finish_offload),
            ("load", session.prepare_load, session.finish_load),
        ):
            if swap:
                job = launch(STAGE, micro)
                job.run()
                wait(STAGE, micro)
            lap(phase)
        if swap and micro == 0:  # what a chunk moves, read outside the timed phases
            group = session.manager.get_group(session.group_name(STAGE, micro))
            self.captured, self.storages = len(group), len(group.spans())
            started = time.thread_time()
        TORCH.autograd.backward(record, torch.ones_like(out), self.params)
        lap("backward")
        session.release_chunk(STAGE, micro)
        lap("release")


@contextmanager
def contention(burst_us: float, period_us: float) -> Iterator[None]:
    """While the block runs, a thread of this process alternates ``period_us`` of sleep
    with ``burst_us`` of Python (nothing when ``burst_us`` is 0)."""
    if burst_us <= 0:
        yield
        return
    stop = threading.Event()

    def contend() -> None:
        while not stop.wait(period_us * 1e-6):
            until = time.perf_counter() + burst_us * 1e-6
            while time.perf_counter() < until:
                pass

    thread = threading.Thread(target=contend, name="bench-contend")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure(
    sessions: int,
    repeats: int,
    burst_us: float = 0.0,
    period_us: float = 200.0,
    model: Model = TINY,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    with contention(burst_us, period_us):
        return _measure(sessions, repeats, model)


def _measure(sessions: int, repeats: int, model: Model) -> dict[str, Any]:
    chunks = Chunks(model)
    chunks.run(True, 3)  # warm-up: pools, caches, first-call costs
    chunks.run(False, 3)
    rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    floors: list[dict[str, float]] = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for swap in (False, True):
                rounds[swap].append(chunks.run(swap, sessions))
            floors.append(chunks.floor(sessions * MICROS_PER_SESSION))
    finally:
        if enabled:
            gc.enable()
    phases = {
        swap: {p: statistics.median(r[p] for r in runs) for p in PHASES}
        for swap, runs in rounds.items()
    }
    totals = {
        swap: statistics.median(sum(r.values()) for r in runs) for swap, runs in rounds.items()
    }
    return {
        "phases": phases,
        "totals": totals,
        "floor": {p: statistics.median(f[p] for f in floors) for p in PHASES},
        "floor_total": statistics.median(sum(f.values()) for f in floors),
        "captured": chunks.captured,
        "storages": chunks.storages,
    }


def main() -> None:
    if "--sweep" in sys.argv[1:]:  # the step sweep, its options its own (swap_sweep.py)
        swap_sweep.main([a for a in sys.argv[1:] if a != "--sweep"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=25, help="sessions per round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per contender")
    parser.add_argument(
        "--contend-us",
        type=float,
        default=0.0,
        help="a thread runs this many us of Python every --contend-period-us (0: none)",
    )
    parser.add_argument("--contend-period-us", type=float, default=200.0, help="(200)")
    parser.add_argument(
        "--model",
        choices=sorted(SIZES),
        default="tiny",
        help="the stage's size: tiny (width 16, the default) or bench_torch_peer's small",
    )
    args = parser.parse_args()
    if args.contend_us < 0 or args.contend_period_us <= 0:
        parser.error(
            f"--contend-us must be >= 0 and --contend-period-us > 0, got {args.contend_us} "
            f"and {args.contend_period_us}"
        )
    model = SIZES[args.model]
    report = measure(args.sessions, args.repeats, args.contend_us, args.contend_period_us, model)
    none, swap = report["phases"][False], report["phases"][True]
    print("| phase | no swap us | swap us | added us |")
    print("|---|---:|---:|---:|")
    for phase in PHASES:
        added_us = swap[phase] - none[phase]
        print(f"| {phase} | {none[phase]:.0f} | {swap[phase]:.0f} | {added_us:+.0f} |")
    base, total = report["totals"][False], report["totals"][True]
    added = total - base
    print(f"| **chunk** | {base:.0f} | {total:.0f} | {added:+.0f} |")
    print()
    print(
        f"Per chunk: {report['captured']} captured saved tensors in {report['storages']} "
        f"storages moved (width {model.dim}, {model.micro_batch} x {model.seq} tokens); swap "
        f"adds {added:.0f} us, {added / report['storages']:.0f} us per storage moved. "
        "Compute-thread CPU "
        f"(time.thread_time), garbage collector off while timed, medians of "
        f"{args.repeats} rounds of {args.sessions * MICROS_PER_SESSION} chunks."
        + (
            f" A thread ran {args.contend_us:g} us of Python every "
            f"{args.contend_period_us:g} us beside them."
            if args.contend_us > 0
            else ""
        )
    )
    floor = report["floor"]
    print(
        f"\nThe least a swap must do (hooks that keep each saved tensor; per storage one host "
        f"byte view, one copy into a pooled buffer, its views dropped; one block per chunk "
        f"loaded, every view rebuilt on it; no checks, states or accounting): the forward "
        f"takes {floor['forward']:.0f} us, {floor['forward'] - none['forward']:+.0f} us over "
        f"no swap, against {swap['forward'] - none['forward']:+.0f} us with swap; the chunk "
        f"{report['floor_total']:.0f} us, {report['floor_total'] - base:+.0f} us over no "
        f"swap, against {added:+.0f} us with swap (offload {floor['offload']:.0f}, load "
        f"{floor['load']:.0f}, backward {floor['backward'] - none['backward']:+.0f} us)."
    )


if __name__ == "__main__":
    main()
