"""Helpers of the torch backend tests: a small torch stage model, seeded stages, data, the
loss, the unsplit reference, and what the swap plan predicts per rank.

The stage model holds two blocks, each wrapped with ``swap_wrapper`` (so ``swap=True``
really moves their saved activations):

- :class:`AttentionBlock`: layer norm, a fused qkv projection rearranged into heads (one
  copy) and unbound into q, k and v, three views of one storage at offsets 0, n and 2n;
  scores ``bmm(q, k.transpose(1, 2))`` (it saves the transposed k: a non-contiguous view
  at an offset), softmax, ``bmm(attn, v)``, a residual. The copy engine must restore
  such views with their original strides for the backward to be bit-identical.
- :class:`MLPBlock`: ``x + fc2(tanh(fc1(x)))``.

Inputs are ``(batch, SEQ, DIM)`` float32. Everything is small (dim 8, 2 heads, seq 4) so
that a run takes tens of milliseconds on two CPU cores.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

# tests/ (stage_runs) for the torchrun and mpiexec scripts, which put only this folder on
# the path; under pytest it is there already.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stage_runs import stage_runs_holding_chunks

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.backends.torch.autograd import TorchRecord
from ppswap.backends.torch.backend import TorchBackend
from ppswap.fsdp import DeviceMesh, full_gradients, fully_shard
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import memory_table
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapGroup, swap_wrapper
from ppswap.swap.entries import GroupPhase

__all__ = [
    "BATCH",
    "DIM",
    "GPIPE_CASE",
    "HEADS",
    "SEQ",
    "AttentionBlock",
    "Case",
    "MLPBlock",
    "Prediction",
    "StageModel",
    "assert_clean",
    "build_flat_stages",
    "build_modules",
    "build_stages",
    "full_grads_by_stage",
    "grads_of",
    "leftovers",
    "make_data",
    "make_flat_data",
    "mse_loss",
    "predictions",
    "run_case",
    "sharded_stages",
    "unsplit_loss_and_grads",
]

DIM = 8
HEADS = 2
SEQ = 4
HIDDEN = 15  # odd: FSDP dp=2 pads the shards of fc1
BATCH = 8

Array = npt.NDArray[np.float32]


class AttentionBlock(nn.Module):
    """Pre-norm self-attention with a residual; saves strided views (module docstring)."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = float(self.head_dim) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        heads, head_dim = self.heads, self.head_dim
        qkv = self.qkv(self.norm(x)).reshape(batch, seq, 3, heads, head_dim)
        # One copy into (3, batch * heads, seq, head_dim); q, k, v are views of it at
        # offsets 0, n and 2n.
        q, k, v = qkv.permute(2, 0, 3, 1, 4).reshape(3, batch * heads, seq, head_dim).unbind(0)
        scores = torch.bmm(q, k.transpose(1, 2)) * self.scale  # saves q and k transposed
        attn = scores.softmax(dim=-1)
        out = torch.bmm(attn, v)  # saves attn and v (at an offset)
        out = out.reshape(batch, heads, seq, head_dim).transpose(1, 2).reshape(batch, seq, dim)
        projected: torch.Tensor = self.proj(out)
        return x + projected


class MLPBlock(nn.Module):
    """``x + fc2(tanh(fc1(x)))``."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return x + update


class StageModel(nn.Module):
    """One pipeline stage: an attention block then an MLP block, each swap-wrapped when
    ``wrap`` (the wrapper is transparent outside a pipeline run)."""

    def __init__(self, dim: int = DIM, *, wrap: bool = True) -> None:
        super().__init__()
        blocks: list[nn.Module] = [AttentionBlock(dim), MLPBlock(dim)]
        self.blocks = nn.ModuleList([swap_wrapper(b) if wrap else b for b in blocks])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_modules(
    stage_num: int, *, dim: int = DIM, wrap: bool = True, seed: int = 0
) -> list[StageModel]:
    """``stage_num`` stage models with weights drawn from ``seed`` (the global torch RNG
    is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [StageModel(dim, wrap=wrap) for _ in range(stage_num)]


def build_stages(
    stage_num: int, *, dim: int = DIM, wrap: bool = True, seed: int = 0
) -> list[PipelineStage]:
    modules = build_modules(stage_num, dim=dim, wrap=wrap, seed=seed)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def sharded_stages(
    stage_num: int, mesh: DeviceMesh, *, dim: int = DIM, seed: int = 0
) -> list[PipelineStage]:
    """Every (stage, dp replica), each replica built from the same seed and
    ``fully_shard()``-ed with its dp rank."""
    stages: list[PipelineStage] = []
    for dp_rank in range(mesh.dp):
        for index, module in enumerate(build_modules(stage_num, dim=dim, seed=seed)):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


def build_flat_stages(
    stage_num: int, *, dim: int = 16, blocks: int = 3, seed: int = 0
) -> list[PipelineStage]:
    """Stages of ``blocks`` swap-wrapped MLP blocks on 2-d ``(batch, dim)`` inputs: every
    saved activation is a whole storage of its own (no view shares one), so a chunk's
    offloaded bytes are exactly its movable device bytes (the memory-model test)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        modules = [
            nn.Sequential(*(swap_wrapper(MLPBlock(dim, 2 * dim)) for _ in range(blocks)))
            for _ in range(stage_num)
        ]
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def make_flat_data(batch: int, dim: int = 16, *, seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, dim)).astype(np.float32)
    y = rng.standard_normal((batch, dim)).astype(np.float32)
    return x, y


def make_data(batch: int = BATCH, *, dim: int = DIM, seed: int = 1) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, SEQ, dim)).astype(np.float32)
    y = rng.standard_normal((batch, SEQ, dim)).astype(np.float32)
    return x, y


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def grads_of(stages: Sequence[PipelineStage]) -> list[list[torch.Tensor]]:
    """Each stage's gradients, detached copies (a later run cannot change them)."""
    return [[g.detach().clone() for g in stage.grads] for stage in stages]


def unsplit_loss_and_grads(
    modules: Sequence[nn.Module],
    x: Array,
    y: Array,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse_loss,
) -> tuple[float, list[list[torch.Tensor]]]:
    """The reference: every stage module chained on the whole batch, the mean loss and
    ``torch.autograd.grad`` of it for each module's trainable parameters."""
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    out = torch.from_numpy(x)
    for module in modules:
        out = module(out)
    loss = loss_fn(out, torch.from_numpy(y))
    flat = torch.autograd.grad(loss, [p for group in params for p in group])
    grads: list[list[torch.Tensor]] = []
    start = 0
    for group in params:
        grads.append(list(flat[start : start + len(group)]))
        start += len(group)
    return float(loss.detach()), grads


@dataclass(frozen=True)
class Case:
    """A small pipeline configuration."""

    schedule: str = "gpipe"
    pp: int = 2
    stage_num: int = 2
    micro: int = 4
    split_dw: bool = False
    overlap_b_f: bool = False
    p2p: str = "plain"

    @property
    def vpp(self) -> int:
        return self.stage_num // self.pp

    def config(self, *, fsdp: bool = False) -> ScheduleConfig:
        return ScheduleConfig(
            schedule=self.schedule,
            pp=self.pp,
            vpp=self.vpp,
            micro=self.micro,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            fsdp=fsdp,
            swap=True,
        )

    def label(self) -> str:
        flags = [f"pp{self.pp}", f"s{self.stage_num}", f"m{self.micro}", self.p2p]
        flags += ["dw"] * self.split_dw + ["overlap"] * self.overlap_b_f
        return f"{self.schedule}-{'-'.join(flags)}"


GPIPE_CASE = Case("gpipe", pp=2, stage_num=2, micro=4)


async def run_case(
    stages: Sequence[PipelineStage], case: Case, *, swap: bool, **overrides: Any
) -> RunResult:
    """Run ``case`` on ``stages`` with the default data (``overrides``: run_schedule's)."""
    x, y = make_data()
    kwargs: dict[str, Any] = {
        "micro_batch_num": case.micro,
        "inputs": x,
        "targets": y,
        "loss_fn": mse_loss,
        "swap": swap,
        "pp": case.pp,
        "split_dw": case.split_dw,
        "overlap_b_f": case.overlap_b_f,
        "p2p": case.p2p,
        "step_timeout": 60.0,
    }
    kwargs.update(overrides)
    return await run_schedule(list(stages), case.schedule, **kwargs)


@dataclass(frozen=True)
class Prediction:
    """What the swap plan says about one rank: the chunks it swaps and the peak resident
    chunks without and with swap."""

    rank: int
    eligible: frozenset[tuple[int, int]]
    peak_chunks_no_swap: int
    peak_chunks_swap: int

    @property
    def cuts_peak(self) -> bool:
        return self.peak_chunks_swap < self.peak_chunks_no_swap


def predictions(config: ScheduleConfig) -> list[Prediction]:
    """Per rank, from the lowered orders: eligible chunks and the planned peaks (a split
    chunk held until its BWD_WEIGHT, as torch holds it)."""
    orders = build_all_orders(config)
    table = memory_table(replace(config, saved_until=TorchBackend.saved_until))
    return [
        Prediction(
            rank=row["rank"],
            eligible=eligible_chunks(order),
            peak_chunks_no_swap=row["peak_chunks_no_swap"],
            peak_chunks_swap=row["peak_chunks_swap"],
        )
        for row, order in zip(table, orders, strict=True)
    ]


def full_grads_by_stage(stages: Sequence[PipelineStage], stage_num: int) -> list[list[Array]]:
    """FSDP: each stage's full gradients, joined from its dp replicas' shard gradients."""
    return [
        full_gradients([s for s in stages if s.stage_index == index]) for index in range(stage_num)
    ]


# -- what a finished run must not leave behind --------------------------------------------------


def leftovers() -> tuple[int, int, int]:
    """What runs left alive in the process: (swap groups not released, sessions still
    holding chunks, recorded torch forwards still holding their graph)."""
    gc.collect()
    groups = sessions = graphs = 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that dereferences dead weak proxies
        if kind is SwapGroup and obj.phase is not GroupPhase.RELEASED:
            groups += 1
        elif kind is PipelineSwapSession and obj.stats().live_chunks:
            sessions += 1
        elif kind is TorchRecord and obj.output is not None:
            graphs += 1
    return groups, sessions, graphs


def assert_clean(
    stages: Sequence[PipelineStage],
    device: EmulatedDevice,
    baseline: tuple[int, int, int] = (0, 0, 0),
) -> None:
    """Nothing of a finished (failed, cancelled or successful) run is left behind: no
    ppswap thread, no other task, no live swap group or session, no chunk or recorded
    graph (beyond ``baseline``: what other tests left, from ``leftovers()`` before the
    run), no host buffer lent."""
    # A TorchDistTransport's waiting thread may outlive its transport, blocked in gloo
    # until the group's timeout (docs/torch_dist.md, Limits): one another test closed is
    # not this run's (in-process runs make none).
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ppswap-")]
    assert sorted(name for name in threads if name != "ppswap-torch-dist-wait") == []
    current = asyncio.current_task()
    assert {t for t in asyncio.all_tasks() if t is not current and not t.done()} == set()
    assert leftovers() == baseline
    assert stage_runs_holding_chunks() == 0
    pool = device.pool_stats()
    assert pool.lent == 0 and pool.bytes_lent == 0
