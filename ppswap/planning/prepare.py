"""The run planner: stages, options and data in, a checked ``RunPlan`` out, before anything
runs.

Every refusal is a TypeError or ValueError (``PipelineInputError`` for the data) that names
the parameter, the value and what is allowed. Only after ``prepare_run`` returns does the
runtime start a thread or touch a tensor.

What is checked (docs/reliability.md lists the tests):

- the options: ``RunOptions`` checked each field when it was made; here what depends on
  the stages: ``pp`` against ``stage_num`` (and the distributed transport's world size),
  the schedule's rules on its sizes (``RunOptions.schedule_config``: interleaved ``vpp``
  and ``micro``...), the FSDP mesh against the stages' shards (and, across processes,
  against the transport: one process per world rank); ``trace`` a path;
- the backend: every stage's module of one framework (``ppswap.backends``: a module of no
  supported framework is refused at ``PipelineStage``, a mix here), and that framework
  ready to run a pipeline (MindSpore in PYNATIVE_MODE);
- the stages: PipelineStage objects agreeing on ``stage_num``, covering the stage indices
  of the run exactly once (once per dp replica with FSDP; across processes with FSDP, the
  stages of this process's world rank ``w``: pipeline rank ``w % pp``, dp replica
  ``w // pp``);
- the data and ``loss_fn`` (``ppswap.planning.data``).

What cannot be checked without running the model is reported at the first FWD, before any
backward: a feature shape the first layer does not accept (a PipelineError naming the
rank, the compute actor and the step, with the framework's message), a ``loss_fn`` that
raises or returns anything but a scalar tensor (a PipelineInputError naming ``loss_fn``,
wrapped in that PipelineError).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ppswap.backends import type_name
from ppswap.backends.base import Backend, ForwardScope
from ppswap.core.faults import FaultPlan
from ppswap.core.transport import MultiProcessTransport, Transport, is_multi_process
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import MeshPlan, plan_mesh
from ppswap.moe.split import check_expert_stages
from ppswap.options import RunOptions
from ppswap.planning.data import Batches, check_data, split_data
from ppswap.planning.ties import NO_TIES, TieGroup, Ties, orders_with_ties, plan_ties
from ppswap.scheduler.budget import BudgetPlan, plan_memory_budget
from ppswap.scheduler.checks import budgets_per_rank
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.planning import planned_orders
from ppswap.scheduler.recompute_plan import recomputed_chunks
from ppswap.scheduler.steps import FSDP_KINDS as _FSDP_KINDS
from ppswap.scheduler.steps import P2P_KINDS as _P2P_KINDS
from ppswap.scheduler.steps import TIED_GRAD_SUM, Order, iter_leaves
from ppswap.scheduler.user_orders import read_orders
from ppswap.stage import LossFn, PipelineStage
from ppswap.swap.recompute import has_recompute_blocks
from ppswap.swap.tensor import CheckMode
from ppswap.transports.inprocess import InProcessTransport

__all__ = ["RunPlan", "prepare_run", "split_batches", "with_tie_steps"]


def _recomputed(
    stages: Sequence[PipelineStage],
    backend: Backend,
    config: ScheduleConfig,
    options: RunOptions,
    distributed: bool,
) -> frozenset[tuple[int, int]]:
    """``recompute=True``: every chunk of the stages (of this process) holding a
    ``recompute_wrapper`` block. In a run of this process only, no such stage is refused:
    ValueError naming ``recompute``."""
    if not options.recompute:
        return frozenset()
    found = sorted(s.stage_index for s in stages if has_recompute_blocks(backend, s.module))
    if not found and not distributed:
        raise ValueError(
            "recompute=True needs a stage with a recompute_wrapper block, got none "
            f"in stages {sorted(s.stage_index for s in stages)} (wrap blocks with "
            "ppswap.recompute_wrapper, or pass recompute=False)"
        )
    return recomputed_chunks(config, found)


def _budget_plan(
    stages: Sequence[PipelineStage],
    backend: Backend,
    config: ScheduleConfig,
    options: RunOptions,
    distributed: bool,
) -> BudgetPlan | None:
    """``memory_budget``: the planner's choice (``ppswap.scheduler.budget``). It may
    recompute the stages whose chunks ``cost_model`` measured recomputed and, in a run of
    this process only, that hold a ``recompute_wrapper`` block; an impossible budget is a
    ValueError naming ``memory_budget``."""
    if options.memory_budget is None:
        return None
    cost = options.cost_model
    assert cost is not None and cost.stage_bytes is not None  # RunOptions checked it
    measured = {
        stage for stage, sizes in enumerate(cost.stage_bytes) if sizes.recompute_held is not None
    }
    if not distributed:
        measured &= {s.stage_index for s in stages if has_recompute_blocks(backend, s.module)}
    budgets = budgets_per_rank(options.memory_budget, config.pp)
    return plan_memory_budget(config, cost, budgets, frozenset(measured))


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
    # FSDP: the checked DP x PP layout; ranks are then world ranks, ``orders`` indexed by them.
    mesh_plan: MeshPlan | None = None
    forward_scope: ForwardScope = nullcontext
    # Parameters several stages hold (tied embeddings): summed by TIED_GRAD_SUM steps.
    ties: Ties = NO_TIES
    # memory_budget: the planner's choice and predictions (indexed by pipeline rank).
    budget: BudgetPlan | None = None

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
    def target_parts(self) -> int | None:
        """How many parts the targets have (given as a tuple: ``loss_fn`` gets a tuple),
        else None."""
        return len(self.targets) if isinstance(self.targets, tuple) else None

    @property
    def returns_outputs(self) -> bool:
        """A forward-only run without ``loss_fn``: its result is the last stage's outputs."""
        return self.options.forward_only and self.loss_fn is None

    @property
    def mesh(self) -> DeviceMesh | None:
        """The FSDP mesh (None without one)."""
        return None if self.mesh_plan is None else self.mesh_plan.mesh

    def stages_of(self, rank: int) -> tuple[PipelineStage, ...]:
        if self.mesh_plan is not None:
            return self.mesh_plan.stages_of(rank, self.stages, self.config.rank_of)
        return tuple(s for s in self.stages if self.config.rank_of(s.stage_index) == rank)

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica of ``rank`` (0 without a mesh)."""
        return 0 if self.mesh_plan is None else self.mesh_plan.dp_index(rank)


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
    mesh_plan = plan_mesh(stage_list, options.mesh, options.pp, distributed)
    mesh = None if mesh_plan is None else mesh_plan.mesh
    check_expert_stages(stage_list, mesh, one_process=distributed is None)
    pp = _resolve_pp(options, stage_num, distributed, mesh)
    config = replace(
        options.schedule_config(pp=pp, vpp=stage_num // pp, fsdp=mesh is not None),
        saved_until=backend.saved_until,  # where the framework frees a split chunk
    )
    local_ranks = _check_coverage(stage_list, config, distributed, mesh_plan)
    check_data(
        backend, stage_list, options, inputs, targets, loss_fn, 1 if mesh is None else mesh.dp
    )
    recompute = _recomputed(stage_list, backend, config, options, distributed is not None)
    budget = _budget_plan(stage_list, backend, config, options, distributed is not None)
    if budget is not None:
        orders = budget.orders
    else:
        orders = planned_orders(config, options.swap_policy, options.cost_model, recompute)
    if mesh_plan is not None:
        orders = mesh_plan.world_orders(orders)
    ties = plan_ties(stage_list, backend, config, mesh, distributed=distributed is not None)
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
        mesh_plan=mesh_plan,
        ties=ties,
        budget=budget,
        forward_scope=backend.caller_forward_scope(
            [backend.device_of(stage.module) for stage in stage_list]
        ),
    )


def with_tie_steps(plan: RunPlan, groups: Sequence[TieGroup]) -> RunPlan:
    """``plan`` whose holder ranks' orders end with the TIED_GRAD_SUM steps of the run's
    ties ``groups`` (known at the run's start across processes: ``resolve_ties``)."""
    if not groups:
        return plan
    orders = orders_with_ties(plan.config, plan.orders, groups)
    capacity = max(_p2p_requests(order) for order in orders) + 1
    return replace(plan, orders=orders, channel_capacity=capacity)


def _p2p_requests(order: Order) -> int:
    """How many requests a rank's P2P channel may hold at once, at most: every send and
    receive of its order (the compute actor posts them without blocking), plus its FSDP
    collectives (an all-gather per unshard, a reduce-scatter per reshard and dtype: four
    dtypes allowed for; the FSDP driver's sends would wait for room, never fail) and an
    all-gather per TIED_GRAD_SUM."""
    requests = 0
    for leaf in iter_leaves(order):
        if leaf.kind in _P2P_KINDS or leaf.kind is TIED_GRAD_SUM:
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
        pp = mesh.pp  # plan_mesh checked a given pp and the world size against the mesh
    elif distributed is not None:
        world = distributed.world_size
        if pp is not None and pp != world:
            raise ValueError(f"pp must equal the distributed world size {world}, got {pp!r}")
        pp = world
    if pp is None and options.order is not None:
        pp = len(read_orders(options.order))  # a given order has one row per rank
    if pp is None:
        if options.schedule == "interleaved_1f1b":
            raise ValueError(
                "pp must be given for interleaved_1f1b (stage_num // pp virtual stages per "
                f"rank), got pp=None with stage_num={stage_num}"
            )
        pp = stage_num
    if stage_num % pp != 0:
        if distributed is not None and mesh is None:
            raise ValueError(
                f"pp={pp} comes from the world size (torchrun --nproc-per-node, mpiexec -n); "
                f"it must divide stage_num={stage_num} (vpp = stage_num // pp)"
            )
        raise ValueError(
            f"pp must divide stage_num={stage_num} (vpp = stage_num // pp), got pp={pp}"
        )
    return pp


def _check_coverage(
    stages: Sequence[PipelineStage],
    config: ScheduleConfig,
    distributed: MultiProcessTransport | None,
    mesh_plan: MeshPlan | None,
) -> tuple[int, ...]:
    """The ranks this process runs; the stage indices given must be exactly theirs, each
    once (with a mesh in one process: per dp replica, which ``plan_mesh`` checked alike)."""
    if mesh_plan is not None:
        local_ranks = mesh_plan.local_ranks
    elif distributed is not None:
        local_ranks = (distributed.rank,)
    else:
        local_ranks = tuple(range(config.pp))
    if distributed is None:
        expected = list(range(config.num_stages))
        where = "an in-process run"
    else:
        rank = distributed.rank
        pipeline_rank = rank if mesh_plan is None else mesh_plan.pipeline_rank(rank)
        expected = sorted(config.stages_of(pipeline_rank))
        where = f"rank {rank} (of {config.pp})" if mesh_plan is None else mesh_plan.where(rank)
    indices = sorted(s.stage_index for s in stages)
    if distributed is None and mesh_plan is not None:
        indices = sorted(set(indices))  # one replica's: plan_mesh checked them alike
    elif len(set(indices)) != len(indices):
        raise ValueError(f"stages must not repeat a stage index, got {indices}")
    if indices != expected:
        raise ValueError(
            f"stages must cover stage indices {expected} exactly once for {where}, got {indices}"
        )
    return local_ranks


def split_batches(plan: RunPlan) -> Batches:
    """The run's micro-batches (``split_data``; compute thread): every replica's share of
    the batch, and the targets where the run has a loss."""
    wanted = plan.targets is not None and not plan.returns_outputs
    parts = plan.config.micro * (1 if plan.mesh is None else plan.mesh.dp)
    return split_data(plan.backend, plan.inputs, plan.targets if wanted else None, parts)
