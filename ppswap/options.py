"""RunOptions: how a run executes, validated once.

``run_schedule``, the schedule classes (``ScheduleGPipe`` ...) and the run planner
(``ppswap.planning.prepare``) share this one type: the keyword arguments of
``run_schedule(...)`` and of a schedule's constructor are its fields, checked here, when
the options are made, before anything runs. A bad value raises a ``TypeError`` or
``ValueError`` naming the parameter, the value and what is allowed; an unknown keyword
names itself and lists the fields.

The options of the schedule itself are checked by the scheduler's own checks
(``ppswap.scheduler.config.check_schedule_options``, which ``ScheduleConfig`` runs too): one
definition of each. What depends on the stages (``pp`` against ``stage_num``, interleaved
``vpp``, the mesh against the stages' shards) is checked by the planner, which knows them,
when it builds the run's ``ScheduleConfig`` (``RunOptions.schedule_config``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ppswap.backends.base import CopyEngine
from ppswap.core.deadlines import DEFAULT_STEP_TIMEOUT_S
from ppswap.core.faults import FaultPlan
from ppswap.core.protocols import conforms
from ppswap.core.transport import Transport, is_transport
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.scheduler.checks import check_bool, check_int, check_memory_budget, check_one_of
from ppswap.scheduler.config import (
    DEFAULT_MIN_SWAP_GAP,
    P2PMode,
    ScheduleConfig,
    ScheduleName,
    check_schedule_options,
)
from ppswap.scheduler.cost import SWAP_POLICIES, CostModel, SwapPolicy, check_swap_policy
from ppswap.scheduler.user_orders import OrderSpec, check_orders_given, read_orders
from ppswap.swap.manager import SWAP_MIN_BYTES
from ppswap.swap.tensor import CHECK_MODES, CheckMode

__all__ = ["DEFAULT_STEP_TIMEOUT_S", "RunOptions"]


def _check_positive(name: str, value: object, what: str) -> None:
    """``value`` is an int or float (not a bool) above 0 (NaN is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_instance(name: str, value: object, kind: type, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must {what} or None, got {type(value).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Every option of a run (see the module docstring); ``micro_batch_num`` is required.

    ``schedule``: ``"gpipe" | "1f1b" | "interleaved_1f1b"``; ``pp``: the number of ranks
    (default ``stage_num``; required for interleaved, where ``vpp = stage_num // pp``;
    under a distributed transport its world size); ``swap``: inject the four swap steps;
    ``split_dw``, ``overlap_b_f``, ``p2p``: the schedule's variants; ``min_swap_gap``:
    the gap rule; ``swap_policy`` / ``cost_model``: which chunks move (``"gap"``, the
    default: every chunk the gap rule admits; ``"peak"``: the fewest of those that give
    the same peak, ``ppswap.scheduler.peak``; ``"cost"``: a subset whose copies fit a
    budget, ``ppswap.scheduler.cost``); ``swap_check``: how in-place modification of a saved
    tensor is checked (``"sampled"`` digests, ``"full"`` digests; docs/swap.md);
    ``swap_min_bytes``: a saved tensor whose storage is smaller stays on device (counted,
    never moved; default 0: every marked tensor may move; 4096 keeps what is not worth
    its bookkeeping on device, docs/swap.md);
    ``count_saved_bytes``: count every rank's saved activations
    (``RankStats.peak_saved_bytes``) through saved-tensor hooks; False leaves a rank
    whose plan swaps no chunk (every rank of a run without swap) free of hooks, with
    ``peak_saved_bytes`` 0; a rank that swaps still passes every saved tensor through the
    swap layer, which counts it;
    ``loss_scale``: each micro-batch's backward is seeded with ``loss_scale /
    micro_batch_num`` instead of ``1 / micro_batch_num``, so every gradient is the mean
    loss's times ``loss_scale`` (the losses reported are not scaled): float16 training
    with ``torch.amp.GradScaler``, which unscales them before its step (README);
    ``recompute``: every chunk of a stage with a ``recompute_wrapper`` block is recomputed
    (a RECOMPUTE step before its backward, ``ppswap.swap.recompute``; with ``swap``, the
    swap policy still moves what the other blocks save); refused on a forward-only run
    and, when every stage runs in this process, where no stage has such a block;
    ``memory_budget``: bytes of saved activations per rank (an int for every rank, or a
    mapping rank -> int) that the planner keeps every rank's peak within, choosing per
    chunk keep, swap (with ``swap=True``) or recompute (on stages with a
    ``recompute_wrapper`` block) at the least predicted step time
    (``ppswap.scheduler.budget``); it plans from ``cost_model``, which must carry measured
    chunk bytes (``CostModel.from_result(result)`` of earlier steps); it replaces
    ``swap_policy`` and ``recompute``; refused on a forward-only run;
    ``forward_only``: evaluation (no graph, no swap); ``step_timeout``: the deadline of
    every single wait; ``transport`` (default in-process), ``device`` (the copy engine;
    default the stages' backend's), ``mesh`` (FSDP; read from the stages when None),
    ``faults`` (tests); ``order``: every rank's compute order in torch's action notation
    (rows of ``"0F0"``, ``"1I0"`` ..., or the path of the CSV torch's schedules write;
    ``ppswap.scheduler.user_orders``), run instead of ``schedule``'s (pp defaults to its
    number of rows).
    """

    micro_batch_num: int
    schedule: ScheduleName = "gpipe"
    pp: int | None = None
    swap: bool = False
    split_dw: bool = False
    overlap_b_f: bool = False
    p2p: P2PMode = "plain"
    min_swap_gap: int = DEFAULT_MIN_SWAP_GAP
    swap_policy: SwapPolicy = "gap"
    cost_model: CostModel | None = None
    swap_check: CheckMode = "sampled"
    swap_min_bytes: int = SWAP_MIN_BYTES
    count_saved_bytes: bool = True
    recompute: bool = False
    memory_budget: int | Mapping[int, int] | None = None
    loss_scale: float = 1.0
    forward_only: bool = False
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S
    transport: Transport | None = None
    device: CopyEngine | None = None
    mesh: DeviceMesh | None = None
    faults: FaultPlan | None = None
    order: OrderSpec | None = None

    def __post_init__(self) -> None:
        check_schedule_options(
            schedule=self.schedule,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            swap=self.swap,
            min_swap_gap=self.min_swap_gap,
            forward_only=self.forward_only,
        )
        check_int("micro_batch_num", self.micro_batch_num, 1)
        if self.pp is not None:
            check_int("pp", self.pp, 1)
        check_bool("count_saved_bytes", self.count_saved_bytes)
        check_bool("recompute", self.recompute)
        if self.recompute and self.forward_only:
            raise ValueError(
                "recompute must be False for a forward-only run, got recompute=True "
                "(there is no backward to recompute for)"
            )
        check_one_of("swap_policy", self.swap_policy, SWAP_POLICIES)
        if self.memory_budget is None:
            check_swap_policy(self.swap_policy, self.cost_model)
        else:
            self._check_memory_budget()
        check_one_of("swap_check", self.swap_check, CHECK_MODES)
        check_int("swap_min_bytes", self.swap_min_bytes, 0)
        _check_positive("loss_scale", self.loss_scale, "a finite number > 0")
        if math.isinf(self.loss_scale):
            raise ValueError(f"loss_scale must be a finite number > 0, got {self.loss_scale!r}")
        _check_positive("step_timeout", self.step_timeout, "a number of seconds > 0")
        if self.transport is not None and not is_transport(self.transport):
            raise TypeError(
                "transport must implement ppswap's Transport protocol or None, got "
                f"{type(self.transport).__name__}"
            )
        if self.device is not None and not conforms(self.device, CopyEngine):
            raise TypeError(
                f"device must implement CopyEngine or None, got {type(self.device).__name__}"
            )
        _check_instance("mesh", self.mesh, DeviceMesh, "be a ppswap.DeviceMesh")
        _check_instance("faults", self.faults, FaultPlan, "be a ppswap.core.faults.FaultPlan")
        if self.order is not None:
            read_orders(self.order)  # its notation, now; the rest once the stages are known

    def _check_memory_budget(self) -> None:
        check_memory_budget(self.memory_budget, self.pp)
        if self.forward_only:
            raise ValueError(
                f"memory_budget must be None for a forward-only run, got {self.memory_budget!r} "
                "(nothing is saved for a backward)"
            )
        if self.swap_policy != "gap" or self.recompute:
            raise ValueError(
                "memory_budget chooses every chunk's policy itself: swap_policy must stay 'gap' "
                f"and recompute False, got swap_policy={self.swap_policy!r}, "
                f"recompute={self.recompute!r}"
            )
        if not isinstance(self.cost_model, CostModel) or self.cost_model.stage_bytes is None:
            raise ValueError(
                "memory_budget needs cost_model=CostModel.from_result(result) (chunk bytes "
                "measured by an earlier step of these stages), got "
                f"cost_model={self.cost_model!r}"
            )

    def schedule_config(self, *, pp: int, vpp: int, fsdp: bool) -> ScheduleConfig:
        """The schedule of a run of these options on ``pp`` ranks of ``vpp`` stages each
        (the planner resolves both from the stages), with FSDP steps or not. Only the
        rules that depend on the sizes can still refuse it (``ScheduleConfig``)."""
        return ScheduleConfig(
            schedule=self.schedule,
            pp=pp,
            vpp=vpp,
            micro=self.micro_batch_num,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            fsdp=fsdp,
            swap=self.swap,
            min_swap_gap=self.min_swap_gap,
            forward_only=self.forward_only,
            order=None
            if self.order is None
            else check_orders_given(
                read_orders(self.order),
                pp * vpp,
                self.micro_batch_num,
                forward_only=self.forward_only,
            ),
        )

    @classmethod
    def of(cls, base: RunOptions | None = None, **changes: Any) -> RunOptions:
        """``base`` (or the defaults) with ``changes``; an unknown name is a TypeError
        naming it and listing the options."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(
                f"unknown run option(s) {', '.join(unknown)}; the options are "
                f"{', '.join(sorted(known))}"
            )
        if base is None:
            return cls(**changes)
        if not isinstance(base, RunOptions):
            raise TypeError(f"options must be a RunOptions or None, got {type(base).__name__}")
        return dataclasses.replace(base, **changes)
