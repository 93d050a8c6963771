"""Expert parallelism: exposed all-to-all time with and without overlap_b_f, and EP=2
against EP=1.

    python benchmarks/bench_moe.py [--rounds 7] [--warmup 1] [--delay-ms 2] [--quick]

One torchrun job (``--standalone --nproc_per_node 4``, this script again with
``--worker``): pp2 x dp2, one process per rank over ``TorchDistTransport`` (gloo), one
intra-op thread each. Each stage is a dense residual MLP block and a MoE block
(``ppswap.backends.torch.moe.MoE``, width 64, 4 experts of hidden 256, top-2), 1F1B with
8 micro-batches of 4 sequences of 16 tokens; dense parameters ``fully_shard``-ed.

Contenders, each run once per round in an order rotated round by round:

- ``ep2`` / ``ep2+overlap``: the experts split over EP groups of 2 (``expert_parallel``),
  without and with ``overlap_b_f``; each also with ``--delay-ms`` injected before every
  all-to-all (a transport whose ``all_to_all`` sleeps first, on the event loop), so
  that the exchange's latency is visible on a CPU host;
- ``ep1``: the same model with every expert on every rank (no all-to-all).

Step time: rank 0's wall time of ``run_schedule``, the median over ``--rounds`` after
``--warmup`` rounds. Exposed all-to-all time: the step with the delay minus the step
without it (same overlap), as a share of the step with the delay; against the delay
injected on the rank's critical path (five all-to-alls per MoE leaf pair and micro-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch
from torch import nn

from ppswap import PipelineStage, expert_parallel, fully_shard, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.backends.torch.moe import MoE
from ppswap.core.messages import HostArray
from ppswap.fsdp import DeviceMesh

ROOT = Path(__file__).resolve().parent.parent
MICRO = 8
SEQ = 16
WIDTH = 64
HIDDEN = 256
EXPERTS = 4
WORLD = 4


def _driver(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(WORLD), __file__, "--worker", str(out),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--delay-ms", str(args.delay_ms),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
            return done.returncode
        steps: dict[str, list[float]] = json.loads(out.read_text())
    median = {name: statistics.median(times) * 1e3 for name, times in steps.items()}
    delay = args.delay_ms
    injected = 5 * MICRO * delay  # per rank and step: 3 forward + 2 backward all-to-alls
    print(f"pp2 x dp2, one process per rank (torchrun, gloo), 1F1B m{MICRO}; median of")
    print(f"{args.rounds} rounds after {args.warmup}; {delay} ms injected per all-to-all")
    print(f"({injected:.0f} ms per rank and step); {time.perf_counter() - started:.0f} s.\n")
    print("| contender | step (ms) | with delay (ms) | exposed all-to-all (ms) | share of step |")
    print("|---|---:|---:|---:|---:|")
    for name in ("ep2", "ep2+overlap"):
        plain, slow = median[name], median[f"{name} delay"]
        exposed = slow - plain
        print(f"| {name} | {plain:.1f} | {slow:.1f} | {exposed:.1f} | {exposed / slow:.0%} |")
    print(f"| ep1 (no all-to-all) | {median['ep1']:.1f} | - | - | - |")
    print(f"\nEP=2 / EP=1 step: {median['ep2'] / median['ep1']:.2f}")
    return 0


class Delayed(TorchDistTransport):
    """``TorchDistTransport`` whose all-to-all sleeps ``delay_s`` first."""

    delay_s = 0.0

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> list[HostArray]:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return await super().all_to_all(rank, group, key, arrays)


class Block(nn.Module):
    """A dense residual MLP block, then a residual MoE block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.moe = MoE(WIDTH, HIDDEN, EXPERTS, top_k=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(torch.relu(self.fc1(x)))
        out: torch.Tensor = x + self.moe(x)
        return out


def _worker(args: argparse.Namespace) -> None:
    def stage(ep: int, rank: int) -> PipelineStage:
        mesh = DeviceMesh(pp=2, dp=2, ep=ep)
        coords = mesh.coords(rank)
        torch.manual_seed(0)
        module = [Block() for _ in range(2)][coords.pp]
        if ep > 1:
            expert_parallel(module, mesh=mesh, dp_rank=coords.dp)
        fully_shard(module, mesh=mesh, dp_rank=coords.dp)
        return PipelineStage(module, coords.pp, 2)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    async def main(transport: Delayed) -> None:
        rank = transport.rank
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2 * MICRO * 4, SEQ, WIDTH)).astype(np.float32)
        y = rng.standard_normal(x.shape).astype(np.float32)
        stages = {ep: stage(ep, rank) for ep in (1, 2)}
        contenders = [
            ("ep2", 2, False, 0.0),
            ("ep2 delay", 2, False, args.delay_ms / 1e3),
            ("ep2+overlap", 2, True, 0.0),
            ("ep2+overlap delay", 2, True, args.delay_ms / 1e3),
            ("ep1", 1, False, 0.0),
        ]
        steps: dict[str, list[float]] = {name: [] for name, *_ in contenders}
        for round_index in range(args.warmup + args.rounds):
            shift = round_index % len(contenders)
            for name, ep, overlap, delay in contenders[shift:] + contenders[:shift]:
                transport.delay_s = delay
                started = time.perf_counter()
                await run_schedule(
                    [stages[ep]], "1f1b", micro_batch_num=MICRO, inputs=x, targets=y,
                    loss_fn=loss_fn, overlap_b_f=overlap, transport=transport,
                    step_timeout=120.0,
                )  # fmt: skip
                if round_index >= args.warmup:
                    steps[name].append(time.perf_counter() - started)
        if rank == 0:
            Path(args.worker).write_text(json.dumps(steps))

    torch.set_num_threads(1)
    transport = Delayed(timeout_s=300)
    with transport:
        anyio.run(main, transport)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    if args.worker:
        _worker(args)
        return 0
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
