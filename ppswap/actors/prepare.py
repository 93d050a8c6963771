"""The run planner: stages, options and data in, a checked ``RunPlan`` out, before anything
runs.

Every refusal is a TypeError or ValueError (``PipelineInputError`` for the data) that names
the parameter, the value and what is allowed. Only after ``prepare_run`` returns does the
runtime start a thread or touch a tensor.

What is checked (docs/reliability.md lists the tests):

- the options: ``RunOptions`` checked each field when it was made; here what depends on
  the stages: ``pp`` against ``stage_num`` (and the distributed transport's world size),
  the schedule's own rules (``ScheduleConfig``: interleaved ``vpp``, ``overlap_b_f``
  with GPipe...), the FSDP mesh against the stages' shards (and, across processes,
  against the transport: one process per world rank); ``trace`` a path;
- the backend: every stage's module of one framework (``ppswap.backends``: a module of no
  supported framework is refused at ``PipelineStage``, a mix here), and that framework
  ready to run a pipeline (MindSpore in PYNATIVE_MODE);
- the stages: PipelineStage objects agreeing on ``stage_num``, covering the stage indices
  of the run exactly once (once per dp replica with FSDP; across processes with FSDP, the
  stages of this process's world rank ``w``: pipeline rank ``w % pp``, dp replica
  ``w // pp``);
- the data: ``inputs`` (first stage) and ``targets`` (last stage) are tensors of the
  stages' framework or numpy arrays of a numeric dtype, with a non-empty batch dimension
  divisible by ``micro_batch_num``, of the same batch size; floating inputs have the
  floating dtype of the first stage's parameters (frameworks do not promote: a float64
  batch into a float32 model fails in the first FWD); integer inputs (token ids) are free.
  ``inputs`` may also be a tuple of such (not a list: a nested list of numbers is the
  usual mistake, and is named as one), each split alike: the first stage's module is
  called with one micro-batch of each (``tokens, mask``), or a dict of such with str keys,
  the module then called with them as keyword arguments (``input_ids=...,
  attention_mask=...``); ``targets`` may be a tuple too (``labels, loss_mask``):
  ``loss_fn`` then gets a tuple of one micro-batch of each;
- ``loss_fn``: a callable, required when the run has the last stage, but in a
  forward-only run: without one, that run returns the last stage's outputs
  (``RunResult.outputs``) and needs no targets.

What cannot be checked without running the model is reported at the first FWD, before any
backward: a feature shape the first layer does not accept (a PipelineError naming the
rank, the compute actor and the step, with the framework's message), a ``loss_fn`` that
raises or returns anything but a scalar tensor (a PipelineInputError naming ``loss_fn``,
wrapped in that PipelineError).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ppswap.actors.p2p import InProcessTransport
from ppswap.backends import type_name
from ppswap.backends.base import Backend, ForwardScope
from ppswap.core.dtypes import is_bfloat16, is_floating
from ppswap.core.faults import FaultPlan
from ppswap.core.messages import HostArray
from ppswap.core.packed import MAX_ELEMENTS
from ppswap.core.transport import MultiProcessTransport, Transport, is_multi_process
from ppswap.errors import PipelineInputError
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import (
    check_mesh,
    check_process_stages,
    replica_of,
    resolve_mesh,
    world_orders,
)
from ppswap.options import RunOptions
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.planning import planned_orders
from ppswap.scheduler.steps import Order, StepKind, iter_leaves
from ppswap.stage import LossFn, PipelineStage
from ppswap.swap.tensor import CheckMode

__all__ = ["Batches", "RunPlan", "prepare_run", "split_batches"]


@dataclass(frozen=True, slots=True)
class RunPlan:
    """Everything a run needs, checked: the options, the stages and their backend, the
    schedule's config and every rank's finalized order, the data, and the scope of its
    forwards (``Backend.caller_forward_scope``: on torch, the caller's autocast and
    current CUDA device)."""

    options: RunOptions
    stages: tuple[PipelineStage, ...]
    backend: Backend
    config: ScheduleConfig
    orders: tuple[Order, ...]
    local_ranks: tuple[int, ...]
    loss_fn: LossFn | None
    inputs: Any
    targets: Any
    trace: Path | None
    channel_capacity: int
    # FSDP: the DP x PP mesh; ranks are then world ranks and ``orders`` is indexed by them.
    mesh: DeviceMesh | None = None
    forward_scope: ForwardScope = nullcontext

    @property
    def step_timeout(self) -> float:
        return float(self.options.step_timeout)

    @property
    def faults(self) -> FaultPlan | None:
        return self.options.faults

    @property
    def swap_check(self) -> CheckMode:
        return self.options.swap_check

    @property
    def swap_min_bytes(self) -> int:
        return self.options.swap_min_bytes

    @property
    def count_saved_bytes(self) -> bool:
        return self.options.count_saved_bytes

    @property
    def input_keys(self) -> tuple[str, ...] | None:
        """The keyword names the first stage's module is called with (inputs given as a
        dict; each micro-batch holds its parts in this order), else None."""
        return tuple(self.inputs) if isinstance(self.inputs, dict) else None

    @property
    def returns_outputs(self) -> bool:
        """A forward-only run without ``loss_fn``: its result is the last stage's outputs."""
        return self.options.forward_only and self.loss_fn is None

    @property
    def runs_batches(self) -> bool:
        """Whether a rank's consecutive local steps run as one batch on the compute thread
        (``actors/batch.py``): not with FSDP, whose collectives are steps of their own,
        and not under a fault plan, which injects its faults one step at a time."""
        return self.mesh is None and self.faults is None

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
    """The micro-batches, as contiguous host arrays (index = micro-batch; an input given
    as a tuple of arrays: a tuple per micro-batch)."""

    inputs: list[HostArray] | list[tuple[HostArray, ...]]
    targets: list[HostArray] | list[tuple[HostArray, ...]] | None

    def of_replica(self, dp_index: int, micro: int) -> Batches:
        """The ``micro`` micro-batches of dp replica ``dp_index``: the batch is split into
        dp contiguous blocks, each block into micro-batches (replica-major order)."""
        low, high = dp_index * micro, (dp_index + 1) * micro
        targets = None if self.targets is None else self.targets[low:high]
        return Batches(self.inputs[low:high], targets)


def prepare_run(
    stages: Sequence[PipelineStage],
    options: RunOptions,
    *,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    trace: str | Path | None,
) -> RunPlan:
    """Check the run against its stages and data and build the finalized orders; read
    the calling thread's settings the forwards run under (``RunPlan.forward_scope``)."""
    if trace is not None and not isinstance(trace, str | Path):
        raise TypeError(f"trace must be a file path (str or Path) or None, got {trace!r}")
    stage_list = _check_stages(stages)
    backend = _check_backend(stage_list)
    stage_num = stage_list[0].stage_num
    distributed = _multi_process(options.transport)
    mesh = resolve_mesh(stage_list, options.mesh)
    pp = _resolve_pp(options, stage_num, distributed, mesh)
    config = ScheduleConfig(
        schedule=options.schedule,
        pp=pp,
        vpp=stage_num // pp,
        micro=options.micro_batch_num,
        split_dw=options.split_dw,
        overlap_b_f=options.overlap_b_f,
        p2p=options.p2p,
        swap=options.swap,
        min_swap_gap=options.min_swap_gap,
        forward_only=options.forward_only,
        fsdp=mesh is not None,
    )
    if mesh is not None:
        check_mesh(mesh, pp, distributed)
    local_ranks = _check_coverage(stage_list, config, distributed, mesh)
    _check_data(backend, stage_list, options, inputs, targets, loss_fn, mesh)
    orders = planned_orders(config, options.swap_policy, options.cost_model)
    orders = world_orders(orders, mesh)
    return RunPlan(
        options=options,
        stages=tuple(sorted(stage_list, key=lambda s: s.stage_index)),
        backend=backend,
        config=config,
        orders=orders,
        local_ranks=local_ranks,
        loss_fn=loss_fn,
        inputs=inputs,
        targets=targets,
        trace=None if trace is None else Path(trace),
        channel_capacity=max(_p2p_requests(order) for order in orders) + 1,
        mesh=mesh,
        forward_scope=backend.caller_forward_scope(
            [backend.device_of(stage.module) for stage in stage_list]
        ),
    )


_P2P_KINDS = frozenset({StepKind.SEND_F, StepKind.SEND_B, StepKind.RECV_F, StepKind.RECV_B})
_FSDP_KINDS = frozenset({StepKind.FSDP_UNSHARD, StepKind.FSDP_RESHARD})


def _p2p_requests(order: Order) -> int:
    """How many requests a rank's P2P channel may hold at once, at most: every send and
    receive of its order (the compute actor posts them without blocking), plus its FSDP
    collectives (an all-gather per unshard, a reduce-scatter per reshard and dtype: four
    dtypes allowed for; the FSDP driver's sends would wait for room, never fail)."""
    requests = 0
    for leaf in iter_leaves(order):
        if leaf.kind in _P2P_KINDS:
            requests += 1
        elif leaf.kind in _FSDP_KINDS:
            requests += 4
    return requests


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


def _multi_process(transport: Transport | None) -> MultiProcessTransport | None:
    """The transport when each rank is its own process (anything but the in-process one)."""
    if transport is None or isinstance(transport, InProcessTransport):
        return None
    if not is_multi_process(transport):
        raise TypeError(
            f"transport must be the in-process transport or a multi-process one with rank "
            f"and world_size attributes, got {type(transport).__name__}"
        )
    return transport


def _resolve_pp(
    options: RunOptions,
    stage_num: int,
    distributed: MultiProcessTransport | None,
    mesh: DeviceMesh | None,
) -> int:
    pp = options.pp
    if mesh is not None:
        # check_mesh checks pp against the mesh, and the world size against mesh.world_size
        pp = mesh.pp if pp is None else pp
    elif distributed is not None:
        world = distributed.world_size
        if pp is not None and pp != world:
            raise ValueError(f"pp must equal the distributed world size {world}, got {pp!r}")
        pp = world
    if pp is None:
        if options.schedule == "interleaved_1f1b":
            raise ValueError(
                "pp must be given for interleaved_1f1b (stage_num // pp virtual stages per "
                f"rank), got pp=None with stage_num={stage_num}"
            )
        pp = stage_num
    if stage_num % pp != 0:
        raise ValueError(
            f"pp must divide stage_num={stage_num} (vpp = stage_num // pp), got pp={pp}"
        )
    return pp


def _check_coverage(
    stages: Sequence[PipelineStage],
    config: ScheduleConfig,
    distributed: MultiProcessTransport | None,
    mesh: DeviceMesh | None,
) -> tuple[int, ...]:
    """The ranks this process runs; the stages must be exactly theirs."""
    if distributed is not None and mesh is not None:
        # One process per world rank: pipeline rank w % pp of dp replica w // pp.
        rank = distributed.rank
        check_process_stages(stages, mesh, rank, config.stages_of(mesh.coords(rank).pp))
        return (rank,)
    if distributed is not None:
        local_ranks: tuple[int, ...] = (distributed.rank,)
        expected = set(config.stages_of(distributed.rank))
        where = f"rank {distributed.rank} (of {config.pp})"
    else:
        local_ranks = tuple(range(config.pp))
        expected = set(range(config.num_stages))
        where = "an in-process run"
    given = {s.stage_index for s in stages}
    if given != expected:
        raise ValueError(
            f"stages must cover stage indices {sorted(expected)} exactly once for {where}, "
            f"got {sorted(s.stage_index for s in stages)}"
        )
    if mesh is None:
        return local_ranks
    pairs = sorted((s.stage_index, replica_of(s)) for s in stages)
    wanted = sorted((index, d) for index in expected for d in range(mesh.dp))
    if pairs != wanted:
        raise ValueError(
            f"stages must hold every stage index {sorted(expected)} once per dp replica "
            f"0..{mesh.dp - 1} (mesh={mesh!r}), got (stage, dp_rank) pairs {pairs}"
        )
    return tuple(range(mesh.world_size))


def _check_data(
    backend: Backend,
    stages: Sequence[PipelineStage],
    options: RunOptions,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    mesh: DeviceMesh | None,
) -> None:
    dp = 1 if mesh is None else mesh.dp
    micro = options.micro_batch_num
    by_index = {s.stage_index: s for s in stages}
    last_index = stages[0].stage_num - 1
    first, last = by_index.get(0), by_index.get(last_index)
    named_inputs = _named_parts("inputs", inputs, keywords=True)
    if first is not None:
        _checked_parts(backend, "inputs", inputs, micro, dp, keywords=True)
        for name, part in named_inputs:
            _check_float_dtype(name, part, first, "first")
    inference = options.forward_only and loss_fn is None  # the last stage's outputs
    if last is not None and not inference:
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable (output, target) -> scalar loss for the last "
                f"stage, got {loss_fn!r} (None only with forward_only=True: the run then "
                "returns the last stage's outputs)"
            )
        named_targets = _checked_parts(backend, "targets", targets, micro, dp)
        for name, part in named_targets:
            _check_float_dtype(name, part, last, "last")
        if first is not None and named_targets[0][1].shape[0] != named_inputs[0][1].shape[0]:
            raise PipelineInputError(
                "inputs and targets must have the same batch size, got "
                f"{named_inputs[0][1].shape[0]} and {named_targets[0][1].shape[0]}"
            )


def _named_parts(name: str, value: Any, *, keywords: bool = False) -> list[tuple[str, Any]]:
    """A batch given as a tuple of parts (or, with ``keywords``, a dict of them by str
    key): each part with its name (``inputs[1]``, ``inputs['mask']``); else the batch
    itself."""
    if isinstance(value, tuple) or (keywords and isinstance(value, dict)):
        kind = "a tuple" if isinstance(value, tuple) else "a dict"
        if not 0 < len(value) <= MAX_ELEMENTS:
            raise PipelineInputError(
                f"{name} as {kind} must hold 1 to {MAX_ELEMENTS} parts, got {len(value)}"
            )
        if isinstance(value, tuple):
            return [(f"{name}[{index}]", part) for index, part in enumerate(value)]
        strays = [key for key in value if not isinstance(key, str) or not key.isidentifier()]
        if strays:
            raise PipelineInputError(
                f"{name} as a dict must have keyword names as keys (the first stage's module "
                f"is called with them), got {strays[0]!r}"
            )
        return [(f"{name}[{key!r}]", part) for key, part in value.items()]
    return [(name, value)]


def _checked_parts(
    backend: Backend, name: str, value: Any, micro: int, dp: int, *, keywords: bool = False
) -> list[tuple[str, Any]]:
    """``value`` (a batch, or a tuple or dict of parts: ``_named_parts``) checked part by
    part, the parts of one batch size; each part with its name."""
    named = _named_parts(name, value, keywords=keywords)
    for part_name, part in named:
        _check_batch(backend, part_name, part, micro, dp)
    sizes = {part.shape[0] for _, part in named}
    if len(sizes) > 1:
        found = ", ".join(f"{part_name} {part.shape[0]}" for part_name, part in named)
        raise PipelineInputError(f"every part of {name} must have one batch size, got {found}")
    return named


_NUMERIC_KINDS = "biuf"


def _check_batch(backend: Backend, name: str, value: Any, micro: int, dp: int) -> None:
    if not (isinstance(value, np.ndarray) or backend.is_tensor(value)):
        raise PipelineInputError(
            f"{name} must be a {backend.tensor_name} or numpy.ndarray, got {type(value).__name__}"
        )
    shape = tuple(value.shape)
    if len(shape) == 0:
        raise PipelineInputError(f"{name} must have a batch dimension, got a scalar")
    dtype = backend.numpy_dtype(value)
    if dtype is not None and dtype.kind not in _NUMERIC_KINDS and not is_bfloat16(dtype):
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


def _check_float_dtype(name: str, value: Any, stage: PipelineStage, which: str) -> None:
    """A floating batch (inputs for the first stage, targets for the last) must have the
    (single) floating dtype of that stage's parameters (frameworks do not promote)."""
    backend = stage.backend
    dtype = backend.numpy_dtype(value)
    if dtype is None or not is_floating(dtype):
        return
    param_dtypes = {backend.numpy_dtype(p) for p in stage.parameters}
    floating = {d for d in param_dtypes if d is not None and is_floating(d)}
    if len(floating) == 1 and dtype not in floating:
        (expected,) = floating
        raise PipelineInputError(
            f"{name} must have dtype {expected} (the {which} stage's parameters), got {dtype}: "
            f"convert the batch (e.g. {_conversion(backend, value, name, expected)})"
        )


def _conversion(backend: Backend, value: Any, name: str, dtype: np.dtype[Any]) -> str:
    """How to convert a batch to ``dtype`` in the batch's own framework."""
    if backend.name == "torch" and not isinstance(value, np.ndarray):
        return f"{name}.to(torch.{dtype})"
    return f"{name}.astype(np.{dtype})"


def split_batches(plan: RunPlan) -> Batches:
    """Split the batch into micro-batches (compute thread: may read a framework tensor)."""
    parts = plan.config.micro * (1 if plan.mesh is None else plan.mesh.dp)

    def split(value: Any) -> list[HostArray]:
        host = value if isinstance(value, np.ndarray) else plan.backend.to_host(value, copy=False)
        return [np.array(part, copy=True, order="C") for part in np.split(host, parts, axis=0)]

    def split_parts(value: Any) -> list[HostArray] | list[tuple[HostArray, ...]]:
        if isinstance(value, tuple | dict):  # a dict's parts in key order (input_keys)
            parts = value if isinstance(value, tuple) else value.values()
            return list(zip(*(split(part) for part in parts), strict=True))
        return split(value)

    inputs = [] if plan.inputs is None else split_parts(plan.inputs)
    wanted = plan.targets is not None and not plan.returns_outputs
    targets = split_parts(plan.targets) if wanted else None
    return Batches(inputs, targets)
