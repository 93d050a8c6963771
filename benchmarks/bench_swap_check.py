"""What the in-place checks cost the compute thread: ``swap_check="sampled"`` vs ``"full"``.

    python benchmarks/bench_swap_check.py [--chunks 24]

One stage of the demo LM (dim 128, seq 64, 2 blocks, 4 sequences per micro-batch, every
block wrapped with ``swap_wrapper``) runs chunk after chunk through a real swap session:
forward under the capture hooks, offload, load, backward. The compute thread's share of
swap (the forward's capture and seal, ``prepare_*``, ``finish_*``, ``release_chunk``) is
timed with ``time.thread_time`` on that thread (CPU time, steadier than wall time on a
shared machine), with each check mode and with no swap at all; the copies run on a copy
thread and are timed separately. MindSpore's version counter never moves, so both modes
digest every swapped tensor here (on torch the version counter is the check and neither
digests).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.demo.model import LMConfig, build_lm_stages
from ppswap.demo.run import DEMO_LM_SIZES
from ppswap.swap import (
    CheckMode,
    CopyJob,
    EmulatedDevice,
    PipelineSwapSession,
    SwapManager,
    module_state_tensors,
    swap_wrapper,
)

STAGE = 1
MICROS_PER_SESSION = 4
PHASES = ("forward", "swap_prepare", "swap_finish", "backward", "release")
MIN_BYTES_ROW = 4096
VARIANTS: tuple[tuple[CheckMode | None, int], ...] = (
    (None, 0),
    ("sampled", 0),
    ("full", 0),
    ("sampled", MIN_BYTES_ROW),
)
"""(check, min_bytes) of each row; ``check=None``: no swap."""


def _run_copy(job: CopyJob, seconds: list[float]) -> None:
    """Run a copy job on a thread of its own (as the copy stream does), timing it."""

    def body() -> None:
        started = time.thread_time()
        job.run()
        seconds.append(time.thread_time() - started)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()


def measure(check: CheckMode | None, chunks: int, min_bytes: int = 0) -> dict[str, Any]:
    """Compute-thread CPU seconds per chunk by phase; ``check=None``: no swap;
    ``min_bytes``: the session's ``min_bytes`` (``RunOptions.swap_min_bytes``)."""
    cfg = LMConfig(vocab=64, **DEMO_LM_SIZES)  # the demo's LM
    module = build_lm_stages(cfg, 4)[STAGE]
    for index, layer in enumerate(module.layers):
        module.layers[index] = swap_wrapper(layer)
    params = tuple(module.trainable_params())
    state = module_state_tensors(module)

    def forward(x: Tensor) -> Tensor:
        out: Tensor = module(x)
        return out

    engine = EmulatedDevice()
    totals = dict.fromkeys(PHASES, 0.0)
    copy_s: list[float] = []
    swapped_bytes = 0
    swapped_storages = 0
    rng = np.random.default_rng(0)
    sessions = -(-chunks // MICROS_PER_SESSION) + 1  # the first session is a warm-up
    for generation in range(1, sessions + 1):
        eligible = {(STAGE, m) for m in range(MICROS_PER_SESSION)} if check else set()
        session = PipelineSwapSession(
            SwapManager(MINDSPORE),
            engine,
            rank=0,
            generation=generation,
            eligible=eligible,
            check=check or "sampled",
            min_bytes=min_bytes,
        )
        for micro in range(MICROS_PER_SESSION):
            x = Tensor(rng.standard_normal((4, cfg.seq, cfg.dim)).astype(np.float32))
            clock = [time.thread_time()]
            with session.collection_context(STAGE, micro, protected=(x,), parameters=state):
                out, record = MINDSPORE.autograd.record(forward, (x,))
            clock.append(time.thread_time())
            prepare = finish = 0.0
            if check:
                for launch, wait in (
                    (session.prepare_offload, session.finish_offload),
                    (session.prepare_load, session.finish_load),
                ):
                    started = time.thread_time()
                    job = launch(STAGE, micro)
                    prepare += time.thread_time() - started
                    swapped_bytes += job.nbytes if generation > 1 else 0
                    if generation > 1:
                        group = session.manager.get_group(session.group_name(STAGE, micro))
                        swapped_storages += len(group.spans())
                    _run_copy(job, copy_s)
                    started = time.thread_time()
                    wait(STAGE, micro)
                    finish += time.thread_time() - started
            clock.append(time.thread_time())
            grads = MINDSPORE.autograd.backward(
                record, Tensor(np.ones(out.shape, np.float32)), params
            )
            grads[1][0].asnumpy()
            clock.append(time.thread_time())
            session.release_chunk(STAGE, micro)
            clock.append(time.thread_time())
            if generation > 1:
                totals["forward"] += clock[1] - clock[0]
                totals["swap_prepare"] += prepare
                totals["swap_finish"] += finish
                totals["backward"] += clock[3] - clock[2]
                totals["release"] += clock[4] - clock[3]
        session.close()
    measured = (sessions - 1) * MICROS_PER_SESSION
    per_chunk = {phase: seconds / measured for phase, seconds in totals.items()}
    name = check or "no swap"
    return {
        "check": f"{name}, swap_min_bytes={min_bytes}" if min_bytes else name,
        "storages_per_chunk": swapped_storages / 2 / measured,
        "per_chunk_ms": {k: v * 1e3 for k, v in per_chunk.items()},
        "copy_ms_per_chunk": sum(copy_s[-2 * measured :]) / measured * 1e3 if check else 0.0,
        "mib_per_chunk": swapped_bytes / 2 / measured / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    rows: dict[str, list[dict[str, Any]]] = {}
    with MINDSPORE.run_scope():
        for _ in range(args.repeats):
            for check, min_bytes in VARIANTS:
                row = measure(check, args.chunks, min_bytes)
                rows.setdefault(row["check"], []).append(row)
    base = statistics.median(sum(r["per_chunk_ms"].values()) for r in rows["no swap"])
    print(
        "| check | forward ms | swap prepare ms | swap finish ms | backward ms | release ms "
        "| compute thread ms per chunk | over no swap | copy thread ms per chunk "
        "| storages moved per chunk |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        phases = {p: statistics.median(r["per_chunk_ms"][p] for r in runs) for p in PHASES}
        total = statistics.median(sum(r["per_chunk_ms"].values()) for r in runs)
        copy_ms = statistics.median(r["copy_ms_per_chunk"] for r in runs)
        cells = " | ".join(f"{phases[p]:.2f}" for p in PHASES)
        storages = statistics.median(r["storages_per_chunk"] for r in runs)
        print(
            f"| {name} | {cells} | {total:.2f} | {total - base:+.2f} | {copy_ms:.2f} "
            f"| {storages:.0f} |"
        )
    mib = statistics.median(r["mib_per_chunk"] for r in rows["sampled"])
    print()
    print(
        f"Medians of {args.repeats} runs of {args.chunks} chunks; {mib:.1f} MiB swapped per "
        "chunk; compute-thread CPU time (time.thread_time)."
    )


if __name__ == "__main__":
    main()
