"""``ppswap demo --moe``: the torch LM demo with a MoE block per stage, over PP x EP=2.

Every stage of the torch LM (``ppswap.demo.model_torch``) gets, after its transformer
blocks, a residual mixture-of-experts block (``ppswap.backends.torch.moe.MoE``,
``MOE_EXPERTS`` experts, top-``MOE_TOP_K``, drawn from the LM's seed). Every (stage, dp
replica) of the mesh ``DeviceMesh(pp, dp=2, ep=2)`` holds its own copy, its layers
wrapped with ``swap_wrapper``, split by ``expert_parallel`` (half of every block's
experts; tokens reach the others by all-to-all over the EP group) and its dense
parameters sharded by ``fully_shard``. All ``2 * pp`` ranks run in this process. It
trains as the FSDP demo does (``train_replicas``: swap off and on in turn, plain SGD on
each rank's own shards and experts; the losses must agree bit for bit) and prints the
FSDP demo's table. Importing this module imports torch.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from ppswap.backends.torch.moe import MoE
from ppswap.demo.fsdp_demo import FsdpDemoReport, format_fsdp_report, train_replicas
from ppswap.demo.run import (
    DEMO_LM_SIZES,
    DemoModel,
    DemoOptions,
    LMShape,
    lm_batches,
    load_corpus,
    load_demo_model,
)
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.moe import expert_parallel
from ppswap.stage import PipelineStage
from ppswap.swap import swap_wrapper

__all__ = ["MOE_DP", "MOE_EP", "MOE_EXPERTS", "MOE_TOP_K", "main_moe_demo", "run_moe_demo"]

MOE_DP = 2
"""Data-parallel replicas of every stage."""
MOE_EP = 2
"""Replicas in an EP group: each holds ``MOE_EXPERTS // MOE_EP`` experts of a block."""
MOE_EXPERTS = 4
MOE_TOP_K = 2


class MoEResidual(nn.Module):
    """``x + moe(x)`` on ``(batch, seq, dim)`` activations."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.moe = MoE(dim, 2 * dim, MOE_EXPERTS, top_k=MOE_TOP_K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(x)
        return out


def _moe_lm(
    model: DemoModel, cfg: LMShape, stage_num: int, mesh: DeviceMesh
) -> list[PipelineStage]:
    """Every (stage, dp replica): the LM stage with a MoE block, experts split, dense
    parameters sharded."""
    stages: list[PipelineStage] = []
    for dp_rank in range(mesh.dp):
        for index, module in enumerate(model.build_stages(cfg, stage_num)):
            module.layers.append(MoEResidual(cfg.dim, cfg.seed + 1 + index))
            for layer_index, layer in enumerate(module.layers):
                module.layers[layer_index] = swap_wrapper(layer)
            expert_parallel(module, mesh=mesh, dp_rank=dp_rank)
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


def run_moe_demo(opts: DemoOptions) -> FsdpDemoReport:
    """Train the MoE LM over ``DeviceMesh(pp=opts.pp, dp=2, ep=2)``, swap off and on in
    turn. ``opts.batch`` is the global batch: it must divide into 2 blocks of
    ``opts.micro`` micro-batches."""
    if opts.batch % (opts.micro * MOE_DP):
        raise ValueError(
            f"batch must be divisible by micro * dp = {opts.micro * MOE_DP} with --moe, "
            f"got batch={opts.batch}"
        )
    model = load_demo_model("torch")
    model.prepare()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    text = load_corpus()
    cfg = model.config(vocab=len(set(text)), **DEMO_LM_SIZES)
    data = lm_batches(text, cfg, opts.batch, opts.steps)
    mesh = DeviceMesh(pp=opts.pp, dp=MOE_DP, ep=MOE_EP)
    print(
        f"ppswap demo --moe: {opts.schedule} pp={opts.pp} vpp={opts.vpp} dp={MOE_DP} "
        f"ep={MOE_EP} micro={opts.micro} ({mesh.world_size} ranks), torch char LM with a "
        f"{MOE_EXPERTS}-expert top-{MOE_TOP_K} MoE block per stage, {opts.steps} steps",
        file=sys.stderr,
    )
    off, on = train_replicas(opts, model, cfg, mesh, data, split=_moe_lm, name="moe")
    assert off.result is not None and on.result is not None
    return FsdpDemoReport(
        MOE_DP,
        opts.pp,
        off.losses,
        on.losses,
        off.result,
        on.result,
        off.step_times,
        on.step_times,
    )


def main_moe_demo(opts: DemoOptions) -> int:
    """Run the MoE demo, print the report; 0 when swap on/off losses are bit-identical."""
    started = time.perf_counter()
    report = run_moe_demo(opts)
    print(format_fsdp_report(report))
    print(f"traces: {opts.out_dir}/trace_moe_noswap.json, {opts.out_dir}/trace_moe_swap.json")
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if report.losses_no_swap == report.losses_swap else 1
