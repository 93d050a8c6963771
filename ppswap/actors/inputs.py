"""Checking a run's arguments and turning them into a RunPlan, before anything runs.

Every refusal is a TypeError or ValueError (``PipelineInputError`` for the data) that names
the parameter, the value and what is allowed. Only after ``prepare_run`` returns does the
runtime start a thread or touch a tensor.

What is checked (docs/reliability.md lists the tests):

- the backend: every stage's module of one framework (``ppswap.backends``: a module of no
  supported framework is refused at ``PipelineStage``, a mix of frameworks here), and
  that framework ready to run a pipeline (MindSpore in PYNATIVE_MODE: GRAPH_MODE cannot
  split a forward from its backward in time);
- the options: types and ranges of every argument, ``forward_only`` with ``swap``
  (``ScheduleConfig``), ``faults`` a ``FaultPlan``, ``trace`` a path;
- the stages: PipelineStage objects agreeing on ``stage_num``, covering the stage indices
  of the run exactly once;
- the data: ``inputs`` (first stage) and ``targets`` (last stage) are tensors of the
  stages' framework or numpy arrays of a numeric dtype with a non-empty batch dimension divisible by
  ``micro_batch_num``, of the same batch size; floating inputs have the floating dtype of
  the first stage's parameters (MindSpore does not promote: a float64 batch into a float32
  model fails in the first FWD); integer inputs (token ids) are free;
- ``loss_fn``: a callable, required when the run has the last stage (training and
  forward-only runs alike: the losses are the result).

What cannot be checked without running the model is reported at the first FWD, before any
backward: a feature shape the first layer does not accept (a PipelineError naming the
rank, the compute actor and the step, with MindSpore's message), a ``loss_fn`` that raises
or returns anything but a scalar Tensor (a PipelineInputError naming ``loss_fn``, wrapped
in that PipelineError).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ppswap.actors.faults import FaultPlan
from ppswap.actors.messages import HostArray
from ppswap.actors.p2p import InProcessTransport, Transport
from ppswap.backends import type_name
from ppswap.backends.base import Backend
from ppswap.errors import PipelineInputError
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import check_mesh, replica_of, resolve_mesh, world_orders
from ppswap.scheduler.config import P2P_MODES, SCHEDULE_NAMES, ScheduleConfig
from ppswap.scheduler.cost import CostModel, SwapPolicy, build_orders, check_swap_policy
from ppswap.scheduler.steps import Order, iter_leaves
from ppswap.scheduler.validate import validate_all
from ppswap.stage import LossFn, PipelineStage

__all__ = ["Batches", "RunPlan", "prepare_run", "split_batches"]


@dataclass(frozen=True, slots=True)
class RunPlan:
    """Everything a run needs, checked."""

    stages: tuple[PipelineStage, ...]
    backend: Backend
    config: ScheduleConfig
    orders: tuple[Order, ...]
    local_ranks: tuple[int, ...]
    loss_fn: LossFn | None
    inputs: Any
    targets: Any
    step_timeout: float
    trace: Path | None
    channel_capacity: int
    # FSDP: the DP x PP mesh; ranks are then world ranks and ``orders`` is indexed by them.
    mesh: DeviceMesh | None = None
    faults: FaultPlan | None = None

    def stages_of(self, rank: int) -> tuple[PipelineStage, ...]:
        if self.mesh is not None:
            coords = self.mesh.coords(rank)
            return tuple(
                s
                for s in self.stages
                if self.config.rank_of(s.stage_index) == coords.pp and replica_of(s) == coords.dp
            )
        return tuple(s for s in self.stages if self.config.rank_of(s.stage_index) == rank)

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica of ``rank`` (0 without a mesh)."""
        return 0 if self.mesh is None else self.mesh.coords(rank).dp


@dataclass(frozen=True, slots=True)
class Batches:
    """The micro-batches, as contiguous host arrays (index = micro-batch)."""

    inputs: list[HostArray]
    targets: list[HostArray] | None

    def of_replica(self, dp_index: int, micro: int) -> Batches:
        """The ``micro`` micro-batches of dp replica ``dp_index``: the batch is split into
        dp contiguous blocks, each block into micro-batches (replica-major order)."""
        low, high = dp_index * micro, (dp_index + 1) * micro
        targets = None if self.targets is None else self.targets[low:high]
        return Batches(self.inputs[low:high], targets)


def _check_batch(backend: Backend, name: str, value: Any, micro: int, dp: int = 1) -> None:
    if not (isinstance(value, np.ndarray) or backend.is_tensor(value)):
        raise PipelineInputError(
            f"{name} must be a {backend.tensor_name} or numpy.ndarray, got {type(value).__name__}"
        )
    shape = tuple(value.shape)
    if len(shape) == 0:
        raise PipelineInputError(f"{name} must have a batch dimension, got a scalar")
    dtype = backend.numpy_dtype(value)
    if dtype is not None and dtype.kind not in _NUMERIC_KINDS:
        raise PipelineInputError(
            f"{name} must hold numbers (bool, int or float), got dtype {dtype} (shape {shape})"
        )
    if shape[0] == 0:
        raise PipelineInputError(f"{name} must not be empty, got batch size 0 (shape {shape})")
    if shape[0] % (micro * dp) != 0:
        per_replica = f" x dp={dp} (the batch is split across dp replicas)" if dp > 1 else ""
        raise PipelineInputError(
            f"{name} batch size {shape[0]} (shape {shape}) must be divisible by "
            f"micro_batch_num={micro}{per_replica}"
        )


_NUMERIC_KINDS = "biuf"


def _check_float_dtype(name: str, value: Any, stage: PipelineStage, which: str) -> None:
    """A floating batch (inputs for the first stage, targets for the last) must have the
    (single) floating dtype of that stage's parameters (frameworks do not promote)."""
    backend = stage.backend
    dtype = backend.numpy_dtype(value)
    if dtype is None or dtype.kind != "f":
        return
    param_dtypes = {backend.numpy_dtype(p) for p in stage.parameters}
    floating = {d for d in param_dtypes if d is not None and d.kind == "f"}
    if len(floating) == 1 and dtype not in floating:
        (expected,) = floating
        raise PipelineInputError(
            f"{name} must have dtype {expected} (the {which} stage's parameters), got {dtype}: "
            f"convert the batch (e.g. {name}.astype(np.{expected}))"
        )


def _check_backend(stages: Sequence[PipelineStage]) -> Backend:
    """The one backend every stage's module belongs to, ready to run a pipeline."""
    backends = {stage.backend.name: stage.backend for stage in stages}
    if len(backends) != 1:
        kinds = sorted(f"stage {s.stage_index}: {s.backend.name}" for s in stages)
        raise TypeError(f"stages must all be modules of one framework, got {', '.join(kinds)}")
    (backend,) = backends.values()
    for stage in stages:
        if not backend.is_module(stage.module):
            raise TypeError(
                f"stage {stage.stage_index}'s module must be a {backend.module_name} (the "
                f"framework the stage was built with), got {type_name(stage.module)}"
            )
    backend.check_runnable()
    return backend


def prepare_run(
    stages: Sequence[PipelineStage],
    schedule: str,
    *,
    micro_batch_num: int,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    swap: bool,
    pp: int | None,
    split_dw: bool,
    overlap_b_f: bool,
    p2p: str,
    min_swap_gap: int,
    forward_only: bool,
    step_timeout: float,
    transport: Transport | None,
    trace: str | Path | None,
    mesh: DeviceMesh | None = None,
    faults: FaultPlan | None = None,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
) -> RunPlan:
    """Check every argument of ``run_schedule`` and build the finalized orders.

    ``swap_policy`` / ``cost_model``: which chunks swap moves (``ppswap.scheduler.cost``):
    the fixed gap rule (default) or the cost-aware policy under ``cost_model``.
    """
    if faults is not None and not isinstance(faults, FaultPlan):
        raise TypeError(
            f"faults must be a ppswap.actors.faults.FaultPlan or None, got {type(faults).__name__}"
        )
    if trace is not None and not isinstance(trace, str | Path):
        raise TypeError(f"trace must be a file path (str or Path) or None, got {trace!r}")
    if not isinstance(swap, bool):
        raise TypeError(f"swap must be a bool (True or False), got {swap!r}")
    check_swap_policy(swap_policy, cost_model)
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    if not isinstance(p2p, str):
        raise TypeError(f"p2p must be one of {', '.join(P2P_MODES)}, got {p2p!r}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p must be one of {', '.join(P2P_MODES)}, got {p2p!r}")
    if not isinstance(micro_batch_num, int) or isinstance(micro_batch_num, bool):
        raise TypeError(f"micro_batch_num must be an int >= 1, got {micro_batch_num!r}")
    if micro_batch_num < 1:
        raise ValueError(f"micro_batch_num must be an int >= 1, got {micro_batch_num!r}")
    if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)):
        raise TypeError(f"step_timeout must be a number of seconds > 0, got {step_timeout!r}")
    if not step_timeout > 0 or math.isnan(step_timeout):
        raise ValueError(f"step_timeout must be a number of seconds > 0, got {step_timeout!r}")
    if transport is not None and not isinstance(transport, Transport):
        raise TypeError(
            f"transport must implement ppswap's Transport protocol, got {type(transport).__name__}"
        )
    stage_list = _check_stages(stages)
    backend = _check_backend(stage_list)
    stage_num = stage_list[0].stage_num
    distributed = transport is not None and not isinstance(transport, InProcessTransport)
    fsdp_mesh = resolve_mesh(stage_list, mesh)
    dp = 1 if fsdp_mesh is None else fsdp_mesh.dp
    if fsdp_mesh is not None and pp is None and not distributed:
        pp = fsdp_mesh.pp
    pp = _resolve_pp(schedule, pp, stage_num, transport if distributed else None)
    config = ScheduleConfig(
        schedule=schedule,  # type: ignore[arg-type]
        pp=pp,
        vpp=stage_num // pp,
        micro=micro_batch_num,
        split_dw=split_dw,
        overlap_b_f=overlap_b_f,
        p2p=p2p,  # type: ignore[arg-type]
        swap=swap,
        min_swap_gap=min_swap_gap,
        forward_only=forward_only,
        fsdp=fsdp_mesh is not None,
    )
    if fsdp_mesh is not None:
        check_mesh(fsdp_mesh, pp, distributed=distributed)
    if distributed:
        local_rank: int = transport.rank  # type: ignore[union-attr]
        local_ranks: tuple[int, ...] = (local_rank,)
        expected = set(config.stages_of(local_rank))
        where = f"rank {local_rank} (of {pp})"
    else:
        local_ranks = tuple(range(pp))
        expected = set(range(stage_num))
        where = "an in-process run"
    given = {s.stage_index for s in stage_list}
    if given != expected:
        raise ValueError(
            f"stages must cover stage indices {sorted(expected)} exactly once for {where}, "
            f"got {sorted(s.stage_index for s in stage_list)}"
        )
    if fsdp_mesh is not None:
        pairs = sorted((s.stage_index, replica_of(s)) for s in stage_list)
        wanted = sorted((index, d) for index in expected for d in range(dp))
        if pairs != wanted:
            raise ValueError(
                f"stages must hold every stage index {sorted(expected)} once per dp replica "
                f"0..{dp - 1} (mesh={fsdp_mesh!r}), got (stage, dp_rank) pairs {pairs}"
            )
        local_ranks = tuple(range(fsdp_mesh.world_size))
    has_last = (stage_num - 1) in given
    has_first = 0 in given
    if has_first:
        _check_batch(backend, "inputs", inputs, micro_batch_num, dp)
        first = next(s for s in stage_list if s.stage_index == 0)
        _check_float_dtype("inputs", inputs, first, "first")
    if has_last:
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable (output, target) -> scalar loss for the last "
                f"stage, got {loss_fn!r}"
            )
        _check_batch(backend, "targets", targets, micro_batch_num, dp)
        last = next(s for s in stage_list if s.stage_index == stage_num - 1)
        _check_float_dtype("targets", targets, last, "last")
    if has_first and has_last and inputs.shape[0] != targets.shape[0]:
        raise PipelineInputError(
            f"inputs and targets must have the same batch size, got {inputs.shape[0]} "
            f"and {targets.shape[0]}"
        )
    orders = build_orders(config, swap_policy, cost_model)
    validate_all(config, orders)
    orders = world_orders(orders, fsdp_mesh)
    capacity = max(sum(1 for _ in iter_leaves(order)) for order in orders) + 1
    return RunPlan(
        stages=tuple(sorted(stage_list, key=lambda s: s.stage_index)),
        backend=backend,
        config=config,
        orders=orders,
        local_ranks=local_ranks,
        loss_fn=loss_fn,
        inputs=inputs,
        targets=targets,
        step_timeout=float(step_timeout),
        trace=None if trace is None else Path(trace),
        channel_capacity=capacity,
        mesh=fsdp_mesh,
        faults=faults,
    )


def _check_stages(stages: Sequence[PipelineStage]) -> list[PipelineStage]:
    if isinstance(stages, PipelineStage):
        stages = [stages]
    if not isinstance(stages, Sequence) or not stages:
        raise TypeError(f"stages must be a non-empty list of PipelineStage, got {stages!r}")
    for stage in stages:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"stages must hold PipelineStage objects, got {type(stage).__name__}")
    stage_nums = {s.stage_num for s in stages}
    if len(stage_nums) != 1:
        raise ValueError(f"stages must agree on stage_num, got {sorted(stage_nums)}")
    indices = [s.stage_index for s in stages]
    if len({(s.stage_index, replica_of(s)) for s in stages}) != len(indices):
        raise ValueError(
            f"stages must not repeat a stage index (per dp replica), got {sorted(indices)}"
        )
    return list(stages)


def _resolve_pp(schedule: str, pp: int | None, stage_num: int, transport: Transport | None) -> int:
    if transport is not None:
        world: int = getattr(transport, "world_size", 0)
        if pp is not None and pp != world:
            raise ValueError(f"pp must equal the MPI world size {world}, got {pp!r}")
        pp = world
    if pp is None:
        if schedule == "interleaved_1f1b":
            raise ValueError(
                "pp must be given for interleaved_1f1b (stage_num // pp virtual stages per "
                f"rank), got pp=None with stage_num={stage_num}"
            )
        pp = stage_num
    if not isinstance(pp, int) or isinstance(pp, bool):
        raise TypeError(f"pp must be an int >= 1, got {pp!r}")
    if pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if stage_num % pp != 0:
        raise ValueError(
            f"pp must divide stage_num={stage_num} (vpp = stage_num // pp), got pp={pp}"
        )
    return pp


def _to_host(backend: Backend, value: Any) -> HostArray:
    if isinstance(value, np.ndarray):
        return value
    return backend.to_host(value, copy=False)


def split_batches(plan: RunPlan) -> Batches:
    """Split the batch into micro-batches (compute thread: may read a framework tensor)."""
    micro = plan.config.micro * (1 if plan.mesh is None else plan.mesh.dp)
    split: Callable[[Any], list[HostArray]] = lambda value: [  # noqa: E731
        np.array(part, copy=True, order="C")
        for part in np.split(_to_host(plan.backend, value), micro, axis=0)
    ]
    inputs = split(plan.inputs) if plan.inputs is not None else []
    targets = split(plan.targets) if plan.targets is not None else None
    return Batches(inputs, targets)
