"""Measured peak saved-activation bytes per rank without and with swap, and the prediction.

    python benchmarks/bench_memory.py [--backend mindspore|torch] [--json PATH]

The model is the demo transformer LM of the chosen backend (``ppswap.demo.run.
load_demo_model``: ``ppswap.demo.model`` on MindSpore, the default, or
``ppswap.demo.model_torch``) with 8 blocks, cut into equal stages (2 blocks per stage at
pp4, 1 per virtual stage at pp4 vpp2; stage 0 also embeds, the last stage also projects and
takes the loss), every block wrapped with ``swap_wrapper``. The schedules: GPipe, 1F1B
(also with overlap and the dx/dw split), Interleaved 1F1B, GPipe with FSDP, Looped BFS,
Interleaved Zero Bubble, ZBV and DualPipeV (the V schedules place stages ``r`` and
``7 - r`` on rank ``r``). The FSDP row runs two replicas of pp4 (8 ranks in
the process, world rank ``w`` at pipeline rank ``w % 4``), each stage ``fully_shard``-ed
after wrapping; each replica takes half of the batch, so its chunks are half
as large. Parameters are not in these figures (they are never saved activations).

Each schedule runs one training step without swap and one with (the default copy engine,
the ``EmulatedDevice`` the first stage keeps across runs, without throttling: this table is
about memory, ``bench_cost.py`` is about time).
"Measured" is ``RankStats.peak_saved_bytes``: the largest total of distinct device
storages that live chunks held (the swap session's ledger, from real tensor sizes,
parameters excluded).

The prediction is the planner's: ``simulate.memory_table`` gives the peak resident chunks of
each rank without and with swap; chunks are converted to bytes with the measured bytes per
chunk (the no-swap peak divided by the no-swap peak in chunks). The residue (measured minus
predicted, with swap) is what swap cannot move: bytes the session keeps on device because
they alias something that must stay (the stage input, a received buffer, the stage output
handed to the next stage, the loss) and tensors saved outside the wrapped blocks (embedding,
final norm, head and loss on the first and last stages). The memory model counts a swapped
chunk as fully gone; the runtime keeps that part of it on device.

MindSpore runs with ``pynative_synchronize=True``: on this 2-core machine the asynchronous
PyNative launch pipeline made a leaf 10 to 25 times slower under load (its runtime threads
compete with the compute and copy threads for two cores); results are bit-identical.

The prediction releases a chunk whose backward is split where the backend does
(``Backend.saved_until``): MindSpore at its BWD_INPUT (it computes both gradients there),
torch at its BWD_WEIGHT (the dw pass reads the saved tensors; a swapped chunk loaded back
for its BWD_INPUT stays on device until then). Where an order defers a weight past later
slots (Interleaved Zero Bubble, ZBV, DualPipeV's cool-down) torch's planned cut is
therefore smaller than MindSpore's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from ppswap import DeviceMesh, PipelineStage, RunResult, fully_shard, run_schedule
from ppswap.demo.config import LMConfig
from ppswap.demo.run import DEMO_LM_SIZES, DEMO_MODELS, DemoModel, load_demo_model
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import CostModel, SwapPolicy
from ppswap.scheduler.simulate import memory_table
from ppswap.swap import CopyEngine, swap_wrapper

LM = LMConfig(  # the demo's LM; its blocks per stage follow BLOCKS and the schedule
    vocab=64, seq=DEMO_LM_SIZES["seq"], dim=DEMO_LM_SIZES["dim"], heads=DEMO_LM_SIZES["heads"]
)
BLOCKS = 8  # the whole model: 2 blocks per stage at pp4, 1 per virtual stage at pp4 vpp2
MICRO = 8
MICRO_BATCH = 4


@dataclass(frozen=True)
class BenchCase:
    """One schedule of the tables: a name and its ScheduleConfig (``swap`` set per run);
    with ``config.fsdp`` the stages are ``fully_shard``-ed over ``dp`` replicas."""

    name: str
    config: ScheduleConfig
    dp: int = 1

    @property
    def stage_num(self) -> int:
        return self.config.num_stages

    def run_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "pp": cfg.pp,
            "split_dw": cfg.split_dw,
            "overlap_b_f": cfg.overlap_b_f,
            "p2p": cfg.p2p,
            "min_swap_gap": cfg.min_swap_gap,
        }


CASES: tuple[BenchCase, ...] = (
    BenchCase("GPipe pp4 m8", ScheduleConfig(schedule="gpipe", pp=4, micro=MICRO)),
    BenchCase("1F1B pp4 m8", ScheduleConfig(schedule="1f1b", pp=4, micro=MICRO)),
    BenchCase(
        "Interleaved pp4 vpp2 m8",
        ScheduleConfig(schedule="interleaved_1f1b", pp=4, vpp=2, micro=MICRO),
    ),
    BenchCase(
        "1F1B + overlap pp4 m8",
        ScheduleConfig(schedule="1f1b", pp=4, micro=MICRO, overlap_b_f=True),
    ),
    BenchCase(
        "1F1B + overlap + dx/dw pp4 m8",
        ScheduleConfig(schedule="1f1b", pp=4, micro=MICRO, overlap_b_f=True, split_dw=True),
    ),
    BenchCase(
        "GPipe pp4 m8 + FSDP dp2",
        ScheduleConfig(schedule="gpipe", pp=4, micro=MICRO, fsdp=True),
        dp=2,
    ),
    BenchCase(
        "Looped BFS pp4 vpp2 m8",
        ScheduleConfig(schedule="looped_bfs", pp=4, vpp=2, micro=MICRO),
    ),
    BenchCase(
        "Interleaved ZB pp4 vpp2 m8",
        ScheduleConfig(schedule="interleaved_zb", pp=4, vpp=2, micro=MICRO),
    ),
    BenchCase("ZBV pp4 m8", ScheduleConfig(schedule="zbv", pp=4, vpp=2, micro=MICRO)),
    BenchCase("DualPipeV pp4 m8", ScheduleConfig(schedule="dualpipev", pp=4, vpp=2, micro=MICRO)),
)


def configure_mindspore() -> None:
    """PyNative on CPU, synchronous kernel launches (the fast mode on a loaded 2-core box)."""
    ms = importlib.import_module("mindspore")  # only where MindSpore is benchmarked
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)


def configure(backend: str) -> None:
    """Import ``backend``'s demo LM (and its framework) and set the framework up."""
    load_demo_model(backend)
    if backend == "mindspore":
        configure_mindspore()


def build_stages(case: BenchCase, backend: str = "mindspore") -> list[PipelineStage]:
    """The LM cut into the case's equal stages (``BLOCKS // stage_num`` blocks each), every
    block wrapped with ``swap_wrapper``; with FSDP one copy per replica (same seed), each
    ``fully_shard``-ed after wrapping."""
    stage_num = case.stage_num
    mesh = DeviceMesh(pp=case.config.pp, dp=case.dp) if case.config.fsdp else None
    model: DemoModel = load_demo_model(backend)
    stages = []
    for dp_rank in range(case.dp):
        modules = model.build_stages(replace(LM, layers_per_stage=BLOCKS // stage_num), stage_num)
        for index, module in enumerate(modules):
            for position, layer in enumerate(module.layers):
                module.layers[position] = swap_wrapper(layer)
            if mesh is not None:
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


def batch() -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Random token ids and next-token targets for ``MICRO`` micro-batches."""
    rng = np.random.default_rng(0)
    shape = (MICRO * MICRO_BATCH, LM.seq)
    tokens = rng.integers(0, LM.vocab, shape).astype(np.int32)
    targets = rng.integers(0, LM.vocab, shape).astype(np.int32)
    return tokens, targets


@dataclass
class Runner:
    """Runs one case repeatedly over the same stages (stages are reusable across runs)."""

    case: BenchCase
    backend: str = "mindspore"
    stages: list[PipelineStage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stages = build_stages(self.case, self.backend)
        self.loss_fn = load_demo_model(self.backend).loss_fn
        self.inputs, self.targets = batch()

    def run(
        self,
        *,
        swap: bool,
        device: CopyEngine | None = None,
        swap_policy: SwapPolicy = "gap",
        cost_model: CostModel | None = None,
    ) -> RunResult:
        return anyio.run(self._run, swap, device, swap_policy, cost_model)

    async def _run(
        self,
        swap: bool,
        device: CopyEngine | None,
        swap_policy: SwapPolicy,
        cost_model: CostModel | None,
    ) -> RunResult:
        return await run_schedule(
            self.stages,
            self.case.config.schedule,
            micro_batch_num=MICRO,
            inputs=self.inputs,
            targets=self.targets,
            loss_fn=self.loss_fn,
            swap=swap,
            device=device,  # None: the engine the first stage keeps, as a user's run gets
            swap_policy=swap_policy,
            cost_model=cost_model if swap_policy == "cost" else None,
            **self.case.run_kwargs(),
        )


def measure_case(case: BenchCase, backend: str = "mindspore") -> list[dict[str, Any]]:
    """One row per rank: measured peaks without/with swap and the prediction."""
    runner = Runner(case, backend)
    runner.run(swap=False)  # warm-up: first-call costs stay out of nothing measured here
    plain = runner.run(swap=False)
    swapped = runner.run(swap=True)
    if plain.losses != swapped.losses:
        raise RuntimeError(f"{case.name}: swap changed the losses")
    rows = []
    saved_until = runner.stages[0].backend.saved_until
    predictions = memory_table(replace(case.config, saved_until=saved_until))
    for base, swap in zip(plain.ranks, swapped.ranks, strict=True):
        prediction = predictions[base.rank % case.config.pp]  # world rank -> pipeline rank
        chunks_no_swap = prediction["peak_chunks_no_swap"]
        chunk_bytes = base.peak_saved_bytes / chunks_no_swap if chunks_no_swap else 0.0
        predicted = prediction["peak_chunks_swap"] * chunk_bytes
        rows.append(
            {
                "schedule": case.name,
                "rank": base.rank,
                "eligible": prediction["eligible"],
                "peak_no_swap": base.peak_saved_bytes,
                "peak_swap": swap.peak_saved_bytes,
                "offloaded": swap.offloaded_bytes,
                "chunks_no_swap": chunks_no_swap,
                "chunks_swap": prediction["peak_chunks_swap"],
                "chunk_bytes": chunk_bytes,
                "predicted_swap": predicted,
                "residue": swap.peak_saved_bytes - predicted,
                "step_s_no_swap": plain.step_time_s,
                "step_s_swap": swapped.step_time_s,
            }
        )
    return rows


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def reduction(before: float, after: float) -> str:
    return f"{100 * (before - after) / before:.0f}%" if before else "-"


def per_rank_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | rank | swapped chunks | peak no swap MiB | peak swap MiB | reduction "
        "| predicted chunks (no swap -> swap) | predicted swap MiB | residue MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        # A rank that swaps nothing can still differ: an OVERLAP_B_F composite runs its two
        # leaves in either order on the compute thread (B first frees a chunk first).
        order_only = not row["eligible"] and row["peak_swap"] != row["peak_no_swap"]
        mark = " \\*" if order_only else ""
        lines.append(
            f"| {row['schedule']} | {row['rank']} | {row['eligible']}{mark} | "
            f"{mib(row['peak_no_swap'])} | {mib(row['peak_swap'])} | "
            f"{reduction(row['peak_no_swap'], row['peak_swap'])} | "
            f"{row['chunks_no_swap']} -> {row['chunks_swap']} | {mib(row['predicted_swap'])} | "
            f"{mib(row['residue'])} |"
        )
    lines.append(
        "\n\\* swaps no chunk: the difference between the two runs is the order in which "
        "the compute thread ran the two leaves of an OVERLAP_B_F composite (the backward "
        "first releases its chunk before the forward saves a new one), not swap. The "
        "memory model counts a composite as holding both chunks, so a negative residue "
        "there is that order too."
    )
    return "\n".join(lines)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per schedule, the largest rank (what sizes the device), measured and predicted."""
    lines = [
        "| schedule | max peak no swap MiB | max peak swap MiB | measured reduction "
        "| predicted reduction (chunks) | step s no swap | step s swap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(row["schedule"] for row in rows):
        mine = [row for row in rows if row["schedule"] == name]
        before = max(row["peak_no_swap"] for row in mine)
        after = max(row["peak_swap"] for row in mine)
        chunks_before = max(row["chunks_no_swap"] for row in mine)
        chunks_after = max(row["chunks_swap"] for row in mine)
        lines.append(
            f"| {name} | {mib(before)} | {mib(after)} | {reduction(before, after)} | "
            f"{reduction(chunks_before, chunks_after)} | {mine[0]['step_s_no_swap']:.2f} | "
            f"{mine[0]['step_s_swap']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=tuple(DEMO_MODELS), default="mindspore")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    args = parser.parse_args(argv)
    configure(args.backend)
    started = time.perf_counter()
    rows = [row for case in CASES for row in measure_case(case, args.backend)]
    print(
        f"The demo LM on {args.backend}: vocab {LM.vocab}, seq {LM.seq}, dim {LM.dim}, "
        f"{LM.heads} heads, {BLOCKS} blocks ({BLOCKS // 4} per stage at pp4, "
        f"{BLOCKS // 8} per virtual stage at pp4 vpp2); {MICRO} micro-batches of "
        f"{MICRO_BATCH} sequences; p2p plain, min_swap_gap 4, no throttling.\n"
    )
    print("Largest rank per schedule:\n")
    print(summary_table(rows))
    print("\nPer rank:\n")
    print(per_rank_table(rows))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
