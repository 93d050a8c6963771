"""memory_budget measured: the planner's mix against the simple policies, and its planning time.

Models: the torch peer model (``benchmarks/torch_peer_model.py``, pre-norm MLP blocks) and
the MindSpore demo MLP stages (``ppswap.demo.model.build_mlp_stages``), every block wrapped
by ``recompute_wrapper`` and ``swap_wrapper``; pp2 in one process (GPipe, 1F1B,
Interleaved vpp2, 1F1B + overlap_b_f). Copies throttled by ``EmulatedDevice``: *fast* (a
chunk's copy takes a tenth of a forward: copies hide) and *slow* (two forwards per chunk).
Per case: calibration runs (keep everything, the gap rule's swap, recompute everything),
then budgets of 75% and 50% of the keep-everything peak (not below the planner's least)
and recompute-everything's peak. Reported per budget: violations (ranks whose measured
peak exceeds the budget), the worst predicted/measured peak, predicted/measured step, the
step over the best simple policy that fits the budget (keep, the gap rule's swap,
recompute everything: measured), and over recompute-everything. Last, the planning time
of Interleaved pp8 vpp2 m64 (target < 1 s). Steps are medians of ``--repeats`` runs.

    .venv/bin/python benchmarks/bench_budget.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.scheduler.budget import least_budgets, plan_memory_budget
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel, StageBytes
from ppswap.swap import swap_wrapper

SCHEDULES: dict[str, dict[str, Any]] = {
    "GPipe": dict(schedule="gpipe", stage_num=2),
    "1F1B": dict(schedule="1f1b", stage_num=2),
    "Interleaved": dict(schedule="interleaved_1f1b", stage_num=4),
    "1F1B + overlap": dict(schedule="1f1b", stage_num=2, overlap_b_f=True),
}
PP = 2


def torch_case(quick: bool) -> tuple[Callable[[int], list[PipelineStage]], Any, Any, Any, int]:
    import torch
    from torch import nn
    from torch_peer_model import MODELS, QUICK, build_modules, model_data, mse

    model = QUICK if quick else MODELS["small"]

    def stages(stage_num: int) -> list[PipelineStage]:
        modules = build_modules(model, stage_num, wrap=False)
        wrapped = [
            nn.Sequential(*(recompute_wrapper(swap_wrapper(b)) for b in m.children()))
            for m in modules
        ]
        return [PipelineStage(m, i, stage_num) for i, m in enumerate(wrapped)]

    x, y = model_data(model)
    torch.manual_seed(0)
    return stages, x, y, mse, model.micro


def mindspore_case(quick: bool) -> tuple[Callable[[int], list[PipelineStage]], Any, Any, Any, int]:
    import mindspore as ms
    import numpy as np

    from ppswap.demo.model import build_mlp_stages, mse_loss

    ms.set_context(mode=ms.PYNATIVE_MODE)
    dim = 64 if quick else 128

    def stages(stage_num: int) -> list[PipelineStage]:
        modules = build_mlp_stages(
            stage_num, dim=dim, wrap=lambda b: recompute_wrapper(swap_wrapper(b))
        )
        return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, dim)).astype(np.float32)
    return stages, x, np.tanh(x), mse_loss, 8


def run(stages: list[PipelineStage], case: dict[str, Any], data: Any, **options: Any) -> RunResult:
    x, y, loss, micro = data
    kwargs = {k: v for k, v in case.items() if k not in ("schedule", "stage_num")}

    async def main() -> RunResult:
        return await run_schedule(
            stages,
            case["schedule"],
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=loss,
            pp=PP,
            step_timeout=120.0,
            **kwargs,
            **options,
        )

    return anyio.run(main)


def timed(repeats: int, call: Callable[[], RunResult]) -> tuple[RunResult, float]:
    results = [call() for _ in range(repeats)]
    return results[-1], statistics.median(r.step_time_s for r in results)


def peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


def bench_case(
    backend: str, name: str, make: Any, data: Any, speed: str, repeats: int
) -> list[str]:
    case = SCHEDULES[name]
    stages = make(case["stage_num"])
    keep = run(stages, case, data)  # warm-up and the forward time
    forward = keep.ranks[0].compute_job_s["forward"] / keep.ranks[0].compute_jobs["forward"]
    chunk = max(b.held for r in keep.ranks for b in r.chunk_bytes.values())
    copy_s = forward / 10 if speed == "fast" else 2 * forward
    gbps = chunk / copy_s / 1e9
    device = EmulatedDevice(d2h_gbps=gbps, h2d_gbps=gbps)
    keep, keep_s = timed(repeats, lambda: run(stages, case, data))
    swap, swap_s = timed(repeats, lambda: run(stages, case, data, swap=True, device=device))
    recompute, recompute_s = timed(repeats, lambda: run(stages, case, data, recompute=True))
    model = CostModel.from_result(keep, swap, recompute, copy_gbps=gbps)
    config = ScheduleConfig(
        schedule=case["schedule"],
        pp=PP,
        vpp=case["stage_num"] // PP,
        micro=data[3],
        overlap_b_f=bool(case.get("overlap_b_f")),
        swap=True,
    )
    least = least_budgets(config, model, frozenset(range(case["stage_num"])))
    simple = {"keep": (keep, keep_s), "swap": (swap, swap_s), "recompute": (recompute, recompute_s)}
    budgets = {
        f"{int(share * 100)}%": [
            max(int(share * p), q) for p, q in zip(peaks(keep), least, strict=True)
        ]
        for share in (0.75, 0.5)
    }
    budgets["recompute-all"] = [max(p, q) for p, q in zip(peaks(recompute), least, strict=True)]
    rows = []
    for label, budget in budgets.items():
        result, step_s = timed(
            repeats,
            partial(
                run,
                stages,
                case,
                data,
                swap=True,
                device=device,
                memory_budget=dict(enumerate(budget)),
                cost_model=model,
            ),
        )
        violations = sum(p > b for p, b in zip(peaks(result), budget, strict=True))
        peak_ratio = max(r.predicted_peak_saved_bytes / r.peak_saved_bytes for r in result.ranks)
        fitting = [
            s
            for _, (res, s) in simple.items()
            if max(p - b for p, b in zip(peaks(res), budget, strict=True)) <= 0
        ]
        best = min(fitting) if fitting else float("nan")
        policies = [p for r in result.ranks for p in r.chunk_policy.values()]
        moved = sum(p != "keep" for p in policies) / len(policies)
        cut = 1 - max(peaks(result)) / max(peaks(keep))
        rows.append(
            f"| {backend} | {name} | {speed} | {label} | {violations} | {cut:.0%} | {moved:.0%} | "
            f"{peak_ratio:.2f} | {result.ranks[0].predicted_step_s / step_s:.2f} | "
            f"{step_s / best:.2f} | {step_s / recompute_s:.2f} |"
        )
    return rows


def planning_time() -> float:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=8, vpp=2, micro=64, swap=True)
    sizes = (StageBytes(kept=1000, moved=800, recompute_held=250, regenerated=750),) * 16
    cost = CostModel(chunk_bytes=800, d2h_gbps=1.0, h2d_gbps=1.0, leaf_s=1e-3, stage_bytes=sizes)
    stages = frozenset(range(16))
    least = least_budgets(config, cost, stages)
    start = time.perf_counter()
    plan_memory_budget(config, replace(cost, budget=0.0), tuple(2 * x for x in least), stages)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer cases")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("torch", "mindspore", "both"), default="both")
    args = parser.parse_args(argv)
    print(
        "| backend | schedule | copies | budget | violations | peak cut | chunks moved or "
        "recomputed | predicted / measured peak (max) | predicted / measured step | step / "
        "best simple policy that fits | step / recompute-all |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    backends = ("torch", "mindspore") if args.backend == "both" else (args.backend,)
    for backend in backends:
        make, x, y, loss, micro = (torch_case if backend == "torch" else mindspore_case)(args.quick)
        for name in SCHEDULES:
            for speed in ("fast", "slow"):
                if args.quick and speed == "slow" and name != "GPipe":
                    continue
                for row in bench_case(
                    backend, name, make, (x, y, loss, micro), speed, args.repeats
                ):
                    print(row, flush=True)
    print()
    print(f"Planning Interleaved pp8 vpp2 m64 (budget twice the least): {planning_time():.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
