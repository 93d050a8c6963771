"""Helpers for the FSDP tests: sharded replicas, data, the unsplit reference, trace spans."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ppswap import PipelineStage
from ppswap.demo.model import build_mlp_stages
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.swap import swap_wrapper

# dim 7 gives odd first dimensions (14, 7): every parameter needs padding with dp=2.
DIM = 7


def sharded_stages(
    stage_num: int, mesh: DeviceMesh, *, dim: int = DIM, wrap: bool = True
) -> list[PipelineStage]:
    """Every (stage, dp replica) of an MLP pipeline, each replica built with the same seed
    and fully_shard()-ed with its dp rank."""
    stages: list[PipelineStage] = []
    for dp_rank in range(mesh.dp):
        modules = build_mlp_stages(stage_num, dim=dim, wrap=swap_wrapper if wrap else None)
        for index, module in enumerate(modules):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


def batch(size: int, *, dim: int = DIM, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, dim)).astype(np.float32)
    y = rng.standard_normal((size, dim)).astype(np.float32)
    return x, y


@dataclass(frozen=True)
class Span:
    rank: int
    lane: str
    name: str
    start: float
    end: float


def read_spans(path: Path) -> list[Span]:
    """The X events of a Chrome trace written by run_schedule, with lane names."""
    events: list[dict[str, Any]] = json.loads(Path(path).read_text())["traceEvents"]
    lanes = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    return sorted(
        (
            Span(e["pid"], lanes[(e["pid"], e["tid"])], e["name"], e["ts"], e["ts"] + e["dur"])
            for e in events
            if e["ph"] == "X"
        ),
        key=lambda s: (s.rank, s.start),
    )
