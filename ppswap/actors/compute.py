"""The compute actor: walks one rank's finalized order, step by step.

- Compute leaves (FWD, BWD, BWD_INPUT, BWD_WEIGHT) run on the process's compute thread
  (one hop per leaf: the receive conversion, the stage call and the send conversion
  travel together).
- A composite (OVERLAP_B_F / OVERLAP_F_B) runs its two leaves as tasks of a nested task
  group and returns when both are done: a leaf waiting for its receive does not hold up
  the other.
- RECV_* registers a receive with the P2P actor and keeps the reply future; the consuming
  leaf awaits it. SEND_* hands the payload its producer left behind to the P2P actor.
  BATCH_SEND_RECV does the same for each of its sub-steps, in order.
- SWAP_LAUNCH_* prepares the copy on the compute thread and queues it on the rank's copy
  stream, keeping the reply future; SWAP_WAIT_* awaits it (the time spent blocked there is
  the *exposed* copy wait), then finishes the state change on the compute thread. Both
  jobs go on the thread's urgent lane (``DedicatedThread.run_urgent``), ahead of leaves.
- FSDP_* steps are handed to the optional FSDP driver, which also gets a call before
  every compute leaf (``before_compute``: an all-gather issued by FSDP_UNSHARD is awaited
  and installed there, so it overlaps the compute in between) and one after the last step
  (``finish``: the gradient reduce-scatters are awaited and installed).

Every wait has a deadline (``timeout_s``); a missed deadline raises PipelineHangError with
the flight recorder's dump. Any other failure raises PipelineError naming this rank, the
actor and the step.

Forward-only runs (``config.forward_only``) run each FWD without recording a graph (no
backward will come) and copy every output before it is sent.

Fault injection (tests): with a ``FaultPlan`` the actor consults it before every step it
runs (top-level or a composite's leaf); ``faults=None`` costs one ``is None`` test.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import anyio
import structlog
from anyio.abc import ObjectSendStream

from ppswap.actors.executor import DedicatedThread
from ppswap.actors.faults import FaultAction, FaultPlan, FaultSite
from ppswap.actors.messages import (
    CopyJobLike,
    CopyRequest,
    FutureTimeoutError,
    HostArray,
    MessageKey,
    RecvRequest,
    ReplyFuture,
    SendRequest,
)
from ppswap.actors.trace import FlightRecorder
from ppswap.errors import PipelineError, PipelineHangError, first_pipeline_error
from ppswap.logs import log_step
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.stage import PipelineStage, StageCollector

__all__ = ["ComputeActor", "ComputeStats", "FsdpDriver", "SwapDriver"]

T = TypeVar("T")


class SwapDriver(StageCollector, Protocol):
    """The swap session operations the compute actor drives (compute-thread calls)."""

    def prepare_offload(self, stage: int, micro: int) -> CopyJobLike: ...
    def finish_offload(self, stage: int, micro: int) -> int: ...
    def prepare_load(self, stage: int, micro: int) -> CopyJobLike: ...
    def finish_load(self, stage: int, micro: int) -> int: ...
    def release_chunk(self, stage: int, micro: int) -> None: ...


class FsdpDriver(Protocol):
    """Runs FSDP_UNSHARD / FSDP_RESHARD for this rank's stages (``ppswap.fsdp``)."""

    async def run_step(self, step: MetaStep) -> None: ...
    async def before_compute(self, step: MetaStep) -> None: ...
    async def finish(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ComputeStats:
    """``job_s`` / ``jobs``: seconds and count of the compute-thread jobs by kind
    (``JOB_KINDS``), timed on the thread itself, so waiting for the thread is not in them."""

    steps_executed: int
    exposed_copy_wait_s: float
    job_s: Mapping[str, float]
    jobs: Mapping[str, int]


JOB_KINDS = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "swap_prepare",
    "swap_finish",
)
_JOB_OF_BACKWARD = {False: "backward", True: "backward_input"}


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took (run on the compute thread)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


@dataclass(frozen=True, slots=True)
class RankInputs:
    """The micro-batches this rank's first/last stages consume (host arrays)."""

    inputs: Sequence[HostArray]
    targets: Sequence[HostArray] | None


class ComputeActor:
    actor_name = "compute"

    def __init__(
        self,
        *,
        rank: int,
        order: Order,
        config: ScheduleConfig,
        stages: Mapping[int, PipelineStage],
        compute: DedicatedThread,
        session: SwapDriver,
        p2p: ObjectSendStream[SendRequest | RecvRequest],
        copy: ObjectSendStream[CopyRequest],
        recorder: FlightRecorder,
        data: RankInputs,
        generation: int,
        timeout_s: float = math.inf,
        fsdp: FsdpDriver | None = None,
        log_steps: bool = False,
        faults: FaultPlan | None = None,
    ) -> None:
        self.rank = rank
        self._order = order
        self._config = config
        self._stages = stages
        self._compute = compute
        self._session = session
        self._p2p = p2p
        self._copy = copy
        self._recorder = recorder
        self._data = data
        self._generation = generation
        self._timeout_s = timeout_s
        self._fsdp = fsdp
        self._log_steps = log_steps
        self._log = structlog.get_logger("ppswap").bind(rank=rank, actor=self.actor_name)
        self._record = not config.forward_only
        # A forward-only output is not kept by the stage, so it is always copied.
        self._zero_copy_sends = config.p2p == "boundary" and self._record
        self._faults = faults
        self._recvs: dict[MessageKey, ReplyFuture[HostArray]] = {}
        self._outbox: dict[MessageKey, HostArray] = {}
        self._sends: list[ReplyFuture[None]] = []
        self._copies: dict[tuple[StepKind, int, int], ReplyFuture[int]] = {}
        self.losses: dict[int, float] = {}
        self._steps_executed = 0
        self._exposed_wait_s = 0.0
        self._job_s = dict.fromkeys(JOB_KINDS, 0.0)
        self._jobs = dict.fromkeys(JOB_KINDS, 0)
        self._current: str | None = None
        self._waiting: dict[int, str] = {}  # id(future) -> what waits for what (dumps)
        recorder.register_pending(rank, self.actor_name, self._pending)

    def stats(self) -> ComputeStats:
        return ComputeStats(
            self._steps_executed,
            self._exposed_wait_s,
            dict(self._job_s),
            dict(self._jobs),
        )

    def _pending(self) -> list[str]:
        items = [f"at {self._current}"] if self._current else []
        items.append(f"{self._steps_executed} of {len(self._order)} steps done")
        items += sorted(self._waiting.values())
        items += [f"recv {f.label}" for f in self._recvs.values() if not f.done]
        items += [f"copy {f.label}" for f in self._copies.values() if not f.done]
        items += [f"send {f.label}" for f in self._sends if not f.done]
        return items

    # -- the walk -----------------------------------------------------------------------
    async def run(self) -> None:
        """Execute the order, then wait for the sends still in flight; close the channels."""
        async with self._p2p, self._copy:
            for step in self._order:
                self._current = step.short()
                await self._run_step(step)
                self._steps_executed += 1
            if self._fsdp is not None:
                await self._finish_fsdp(self._fsdp)
            self._current = "final sends"
            for future in self._sends:
                await self._wait(future, MetaStep(StepKind.SEND_F, -1, -1, peer=self.rank))
            self._current = None
        if self._recvs or self._copies or self._outbox:
            raise PipelineError(
                f"order ended with unconsumed receives {sorted(map(str, self._recvs))}, "
                f"copies {sorted(map(str, self._copies))} or sends "
                f"{sorted(map(str, self._outbox))}",
                rank=self.rank,
                actor=self.actor_name,
                step="end",
            )

    async def _run_step(self, step: MetaStep) -> None:
        """Run one step (top-level or a composite's leaf); failures name this step."""
        with self._failures_named(step.short()):
            if self._log_steps:
                log_step(self._log, "step", step, self._generation)
            if self._faults is not None:
                await self._inject(self._faults, step)
            await self._dispatch(step)

    @contextmanager
    def _failures_named(self, label: str) -> Iterator[None]:
        """Record ``label`` as a span; turn any failure inside into a PipelineError (or a
        PipelineHangError with the flight recorder's dump) naming rank, actor and ``label``.
        """
        try:
            with self._recorder.span(self.rank, self.actor_name, label):
                yield
        except (PipelineError, anyio.get_cancelled_exc_class()):
            raise
        except FutureTimeoutError as exc:
            raise PipelineHangError(
                str(exc),
                rank=self.rank,
                actor=self.actor_name,
                step=label,
                dump=self._recorder.dump(),
            ) from exc
        except Exception as exc:
            raise PipelineError(
                f"{type(exc).__name__}: {exc}", rank=self.rank, actor=self.actor_name, step=label
            ) from exc

    async def _dispatch(self, step: MetaStep) -> None:
        kind = step.kind
        handler = self._handlers.get(kind)
        if handler is None:
            raise PipelineError(
                f"no handler for {kind.value}",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
        await handler(self, step)

    async def _inject(self, faults: FaultPlan, step: MetaStep) -> None:
        """Apply the plan's compute rule for ``step``: raise or stall on the compute thread
        (the path a MindSpore failure or a stuck kernel takes), or run a callback here."""
        rule = faults.match(FaultSite.COMPUTE, self.rank, step)
        if rule is None:
            return
        self._recorder.note(self.rank, self.actor_name, rule.describe(self.rank, step))
        if rule.action is FaultAction.RAISE:
            await self._call(rule.raise_fault, self.rank, step)
        elif rule.action is FaultAction.DELAY:
            await self._call(time.sleep, rule.delay_s)
        elif rule.callback is not None:
            rule.callback()

    # -- deadlines ---------------------------------------------------------------------
    async def _wait(self, future: ReplyFuture[T], step: MetaStep) -> T:
        self._waiting[id(future)] = f"{step.short()} waits for {future.label}"
        result = await future.wait(self._timeout_s)
        # Only on success: a wait that failed stays listed for the hang dump.
        del self._waiting[id(future)]
        return result

    async def _call(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run on the compute thread with the step deadline (the job itself cannot be
        interrupted: on a missed deadline the run fails and teardown waits for it).
        ``urgent``: on the thread's urgent lane, ahead of the leaves queued there."""
        submit = self._compute.run_urgent if urgent else self._compute.run
        with anyio.move_on_after(self._timeout_s) as scope:
            return await submit(fn, *args)
        assert scope.cancelled_caught
        name = getattr(fn, "__qualname__", repr(fn))
        raise FutureTimeoutError(f"compute job {name} still running after {self._timeout_s}s")

    async def _call_timed(
        self, job: str, fn: Callable[..., T], *args: Any, urgent: bool = False
    ) -> T:
        """``_call``, timing the job on the compute thread into ``stats().job_s[job]``."""
        timed: tuple[T, float] = await self._call(_timed, fn, *args, urgent=urgent)
        result, seconds = timed
        self._job_s[job] += seconds
        self._jobs[job] += 1
        return result

    # -- compute leaves ----------------------------------------------------------------
    async def _fwd(self, step: MetaStep) -> None:
        stage = self._stages[step.stage]
        payload: HostArray
        if stage.is_first:
            payload = self._data.inputs[step.micro]
        else:
            payload = await self._take_recv(MessageKey("F", step.stage, step.micro), step)
        target = None
        if stage.is_last:
            assert self._data.targets is not None
            target = self._data.targets[step.micro]
        if self._fsdp is not None:
            await self._fsdp.before_compute(step)
        result = await self._call_timed(
            "forward", self._fwd_job, stage, step.micro, payload, target
        )
        if stage.is_last:
            self.losses[step.micro] = float(result)
        else:
            self._outbox[MessageKey("F", step.stage + 1, step.micro)] = result

    def _fwd_job(
        self, stage: PipelineStage, micro: int, payload: HostArray, target: HostArray | None
    ) -> HostArray:
        backend = stage.backend
        inputs = backend.from_host(payload)
        target_tensor = None if target is None else backend.from_host(target)
        out = stage.forward(
            micro,
            inputs,
            target_tensor,
            self._session,
            keep_output=self._zero_copy_sends,
            record=self._record,
        )
        # Copy unless the boundary mode hands the output over as is (then the stage keeps
        # `out` alive until its BWD).
        return backend.to_host(out, copy=not self._zero_copy_sends)

    async def _bwd(self, step: MetaStep) -> None:
        stage = self._stages[step.stage]
        grad: HostArray | None = None
        if not stage.is_last:
            grad = await self._take_recv(MessageKey("B", step.stage, step.micro), step)
        split = step.kind is StepKind.BWD_INPUT
        if self._fsdp is not None:
            await self._fsdp.before_compute(step)
        dx = await self._call_timed(
            _JOB_OF_BACKWARD[split], self._bwd_job, stage, step.micro, grad, split
        )
        if dx is not None:
            self._outbox[MessageKey("B", step.stage - 1, step.micro)] = dx

    def _bwd_job(
        self, stage: PipelineStage, micro: int, grad: HostArray | None, split: bool
    ) -> HostArray | None:
        grad_tensor = None if grad is None else stage.backend.from_host(grad)
        dx = stage.backward(micro, grad_tensor, split=split)
        self._session.release_chunk(stage.stage_index, micro)
        return None if dx is None else stage.backend.to_host(dx, copy=True)

    async def _bwd_weight(self, step: MetaStep) -> None:
        if self._fsdp is not None:
            await self._fsdp.before_compute(step)
        backward_weight = self._stages[step.stage].backward_weight
        await self._call_timed("backward_weight", backward_weight, step.micro)

    async def _composite(self, step: MetaStep) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for leaf in step.sub_steps:
                    tg.start_soon(self._run_step, leaf)
        except BaseExceptionGroup as group:
            # Report the leaf that failed first, not the composite around it.
            raise first_pipeline_error(group) from group

    # -- P2P -----------------------------------------------------------------------------
    async def _recv(self, step: MetaStep) -> None:
        direction = "F" if step.kind is StepKind.RECV_F else "B"
        key = MessageKey(direction, step.stage, step.micro)
        assert step.peer is not None
        future: ReplyFuture[HostArray] = ReplyFuture(f"{direction}{step.micro}.s{step.stage}")
        self._recvs[key] = future
        await self._p2p.send(RecvRequest(step, key, step.peer, future))

    async def _take_recv(self, key: MessageKey, step: MetaStep) -> HostArray:
        future = self._recvs.pop(key, None)
        if future is None:
            raise PipelineError(
                f"{step.short()} consumes {key} but no RECV was posted for it",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
        return await self._wait(future, step)

    async def _send(self, step: MetaStep) -> None:
        if step.kind is StepKind.SEND_F:
            key = MessageKey("F", step.stage + 1, step.micro)
        else:
            key = MessageKey("B", step.stage - 1, step.micro)
        payload = self._outbox.pop(key, None)
        if payload is None:
            raise PipelineError(
                f"{step.short()} sends {key} before its producer ran",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
        assert step.peer is not None
        future: ReplyFuture[None] = ReplyFuture(f"{key.direction}{key.micro}.s{key.stage}")
        self._sends.append(future)
        await self._p2p.send(SendRequest(step, key, step.peer, payload, future))

    async def _batch(self, step: MetaStep) -> None:
        for sub in step.sub_steps:
            await self._dispatch(sub)

    # -- FSDP ----------------------------------------------------------------------------
    async def _fsdp_step(self, step: MetaStep) -> None:
        if self._fsdp is None:
            raise PipelineError(
                "the order has FSDP steps but no stage of this rank is fully_shard()-ed",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
        await self._fsdp.run_step(step)

    async def _finish_fsdp(self, fsdp: FsdpDriver) -> None:
        """After the order: the gradient reduce-scatters (errors named like a step's)."""
        label = "fsdp finish"
        self._current = label
        with self._failures_named(label):
            await fsdp.finish()

    # -- swap ----------------------------------------------------------------------------
    async def _launch_copy(self, step: MetaStep) -> None:
        prepare = (
            self._session.prepare_offload
            if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD
            else self._session.prepare_load
        )
        # Urgent: a swap step only starts a copy; with ranks sharing the compute thread it
        # must not wait behind other ranks' leaves (it would not on a device of its own),
        # or its copy starts late and the rank falls behind.
        job = await self._call_timed("swap_prepare", prepare, step.stage, step.micro, urgent=True)
        future: ReplyFuture[int] = ReplyFuture(f"{step.kind.value} s{step.stage} m{step.micro}")
        self._copies[(step.kind, step.stage, step.micro)] = future
        await self._copy.send(CopyRequest(step, job, future))

    async def _wait_copy(self, step: MetaStep) -> None:
        if step.kind is StepKind.SWAP_WAIT_OFFLOAD:
            launch, finish = StepKind.SWAP_LAUNCH_OFFLOAD, self._session.finish_offload
        else:
            launch, finish = StepKind.SWAP_LAUNCH_LOAD, self._session.finish_load
        future = self._copies.pop((launch, step.stage, step.micro), None)
        if future is None:
            raise PipelineError(
                f"{step.short()} waits for a copy that was never launched",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
        started = time.perf_counter()
        moved = await self._wait(future, step)
        waited = time.perf_counter() - started
        self._exposed_wait_s += waited
        await self._call_timed("swap_finish", finish, step.stage, step.micro, urgent=True)
        if self._log_steps:
            log_step(self._log, "swap_wait", step, self._generation, bytes=moved, waited_s=waited)

    _handlers: ClassVar[dict[StepKind, Callable[[ComputeActor, MetaStep], Awaitable[None]]]] = {
        StepKind.FWD: _fwd,
        StepKind.BWD: _bwd,
        StepKind.BWD_INPUT: _bwd,
        StepKind.BWD_WEIGHT: _bwd_weight,
        StepKind.OVERLAP_B_F: _composite,
        StepKind.OVERLAP_F_B: _composite,
        StepKind.RECV_F: _recv,
        StepKind.RECV_B: _recv,
        StepKind.SEND_F: _send,
        StepKind.SEND_B: _send,
        StepKind.BATCH_SEND_RECV: _batch,
        StepKind.FSDP_UNSHARD: _fsdp_step,
        StepKind.FSDP_RESHARD: _fsdp_step,
        StepKind.SWAP_LAUNCH_OFFLOAD: _launch_copy,
        StepKind.SWAP_LAUNCH_LOAD: _launch_copy,
        StepKind.SWAP_WAIT_OFFLOAD: _wait_copy,
        StepKind.SWAP_WAIT_LOAD: _wait_copy,
    }
