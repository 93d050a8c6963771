"""What ppswap's runtime adds over torch.distributed.pipelining, per micro-batch and per step.

    python benchmarks/bench_torch_overhead.py [--rounds 60] [--json PATH] [--timeout-s 300]

``bench_torch_peer.py`` compares step times on a model that computes; this one takes the
compute away to show the rest. The same pre-norm MLP stages at width 8 (two blocks, one
8-token sequence per micro-batch: each leaf computes for tens of microseconds) run 1F1B at
pp2, one process per rank over gloo (``torchrun --standalone --nproc_per_node 2``), with
2 and with 16 micro-batches, under ``torch.distributed.pipelining`` (``Schedule1F1B``) and
under ppswap (``run_schedule`` over ``TorchDistTransport``, no swap,
``count_saved_bytes=False``), the two alternating round by round. Step time as in
``bench_torch_peer.py`` (barrier, rank 0's clock, barrier).

A straight line through each contender's two median step times splits it into a cost per
micro-batch (two messages on the pipeline's critical path, one each way, and per rank
two leaves) and a fixed cost per step (set-up, the pipeline's fill and drain, and for
ppswap the threads, the actors and the result all-gather of every run). Not a target of
its own: it says which part of the gap to torch is per message and which per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench_torch_peer import launch, ppswap_source, run_worker
from torch_peer_model import Model, PeerRunner, build_modules, model_data, mse

TINY = Model(dim=8, blocks=2, micro=2, micro_batch=1, seq=8)
MICROS = (2, 16)
CONTENDERS = ("torch", "ppswap")


def worker(args: argparse.Namespace) -> int:
    """One rank: both micro-batch counts, both contenders, alternating; rank 0 writes."""
    import anyio

    return anyio.run(_worker, args)


async def _worker(args: argparse.Namespace) -> int:
    async def measure(transport: Any) -> dict[str, dict[str, list[float]]]:
        return {
            str(micro): await _measure(replace(TINY, micro=micro), transport, args)
            for micro in MICROS
        }

    return await run_worker(measure, Path(args.out))


async def _measure(
    model: Model, transport: Any, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Step times of both contenders for ``model``, alternating round by round."""
    import torch.distributed as dist

    from ppswap import PipelineStage, run_schedule

    rank, pp = transport.rank, transport.world_size
    x, y = model_data(model)
    peer = PeerRunner("1f1b", model, rank, pp, pp, (x, y))
    modules = build_modules(model, pp, wrap=False)
    stages = [PipelineStage(m, s, pp) for s, m in enumerate(modules) if s % pp == rank]
    xs, ys = x.numpy(), y.numpy()

    async def step(contender: str) -> None:
        if contender == "torch":
            peer.zero_grad()
            peer.step(x, y)
            return
        for module in modules:  # as an optimizer's zero_grad would: each run sets .grad
            module.zero_grad(set_to_none=True)
        await run_schedule(
            stages,
            "1f1b",
            micro_batch_num=model.micro,
            inputs=xs,
            targets=ys,
            loss_fn=mse,
            count_saved_bytes=False,
            transport=transport,
        )

    measured: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for round_index in range(args.warmup + args.rounds):
        shift = round_index % len(CONTENDERS)
        for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
            dist.barrier()
            started = time.perf_counter()
            await step(contender)
            dist.barrier()
            if round_index >= args.warmup:
                measured[contender].append(time.perf_counter() - started)
    return measured


def fit(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per contender: the median step time at each micro-batch count, the cost per
    micro-batch (the slope) and the fixed cost per step (the intercept), in ms."""
    low, high = MICROS
    rows = {}
    for contender in CONTENDERS:
        at_low = statistics.median(times[str(low)][contender]) * 1e3
        at_high = statistics.median(times[str(high)][contender]) * 1e3
        per_micro = (at_high - at_low) / (high - low)
        rows[contender] = {
            f"m{low}_ms": at_low,
            f"m{high}_ms": at_high,
            "per_micro_ms": per_micro,
            "fixed_ms": at_low - low * per_micro,
        }
    return rows


def markdown(report: dict[str, Any]) -> str:
    rows = report["fit"]
    low, high = MICROS
    lines = [
        f"Width-8 model, 1F1B pp2, {report['rounds']} rounds after {report['warmup']} "
        f"(medians); ppswap {report['ppswap']}; load average {report['load_before']} "
        f"before, {report['load_after']} after, on {report['cores']} cores.",
        "",
        f"| contender | step ms at m{low} | step ms at m{high} | per micro-batch ms | "
        "fixed per step ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for contender in CONTENDERS:
        row = rows[contender]
        lines.append(
            f"| {contender} | {row[f'm{low}_ms']:.2f} | {row[f'm{high}_ms']:.2f} | "
            f"{row['per_micro_ms']:.3f} | {row['fixed_ms']:.2f} |"
        )
    torch_row, ours = rows["torch"], rows["ppswap"]
    lines += [
        "",
        f"ppswap over torch: {ours['per_micro_ms'] / torch_row['per_micro_ms']:.2f}x per "
        f"micro-batch (+{ours['per_micro_ms'] - torch_row['per_micro_ms']:.3f} ms: two "
        f"messages and two leaves per rank), +{ours['fixed_ms'] - torch_row['fixed_ms']:.2f} "
        "ms fixed per step.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="measured rounds per count")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured rounds per count")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="kill the torchrun job (its whole process group) after this long",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    for name, least in (("rounds", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppswap-overhead-") as scratch:
        out = Path(scratch) / "times.json"
        worker_args = ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        launch(Path(__file__).resolve(), worker_args, 2, args.timeout_s, out)
        times = json.loads(out.read_text())
    report = {
        "model": asdict(TINY),
        "micros": list(MICROS),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "cores": os.cpu_count(),
        "ppswap": ppswap_source(),
        "load_before": ", ".join(f"{v:.2f}" for v in load_before),
        "load_after": ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "times_s": times,
        "fit": fit(times),
    }
    print(markdown(report))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
