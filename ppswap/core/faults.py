"""Fault injection for tests: a frozen, explicit plan of what goes wrong where.

``run_schedule(..., faults=FaultPlan(rules=(...)))`` hands the plan to the actors of every
rank; ``faults=None`` (the default) costs one ``is None`` test per step and nothing else.
There is no global state: the plan is plain data, read by the actors of that one run.

A rule matches a step by its actor (``site``), the rank that serves it, its kind and,
optionally, its stage and micro-batch (``None`` matches any). Rules are stateless: a rule
fires every time it matches (give stage and micro to fire once per run). The first
matching rule of the plan wins.

Sites, the steps they see and what they can do:

- ``COMPUTE`` (the compute actor; the step may be a leaf inside a composite): ``RAISE``
  on the compute thread in FWD / BWD / BWD_INPUT / BWD_WEIGHT / RECOMPUTE and in a
  TIED_GRAD_SUM's sum (the failure travels the same path as a MindSpore error would);
  ``DELAY`` blocks the compute thread for ``delay_s`` before such a step (a stuck kernel:
  the step deadline applies); ``CALL`` runs
  ``callback()`` on the event loop before a step of any kind (tests cancel a run at an
  exact step with it). ``ComputeFaults`` applies them on the path every run takes: RAISE
  and DELAY *wrap* the step's body in its batch, and a batch ends before a step with a
  CALL rule, whose callback runs on the loop before the next batch starts with it.
- ``COPY`` (the copy-stream actor, before it runs a copy; the step is the
  SWAP_LAUNCH_OFFLOAD / SWAP_LAUNCH_LOAD that queued it): ``RAISE`` or ``DELAY`` the copy
  (a slow copy engine).
- ``P2P`` (the P2P actor, before it hands a request to the transport; the step is the
  SEND_* / RECV_*): ``RAISE`` in a send or a receive, ``DELAY`` a message (a slow link),
  ``DROP`` a sent message (the send reports success, the peer never gets it: the peer's
  receive deadline turns that into a ``PipelineHangError``).

Every injected failure is an :class:`InjectedFault`; the actor that meets it reports a
``PipelineError`` naming its rank, itself and the step, like any other failure.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from ppswap.scheduler.steps import (
    P2P_KINDS,
    RUNS_MODULE_KINDS,
    SEND_KINDS,
    SWAP_LAUNCH_KINDS,
    TIED_GRAD_SUM,
    MetaStep,
    StepKind,
)

__all__ = [
    "ComputeFaults",
    "FaultAction",
    "FaultPlan",
    "FaultRule",
    "FaultSite",
    "InjectedFault",
    "call_at",
    "delay_compute",
    "delay_copy",
    "delay_message",
    "drop_message",
    "fail_compute",
    "fail_copy",
    "fail_p2p",
]


class InjectedFault(RuntimeError):
    """The exception a ``RAISE`` rule raises (its message names the rule)."""


class FaultSite(enum.Enum):
    """Which actor a rule applies to."""

    COMPUTE = "compute"
    COPY = "copy"
    P2P = "p2p"


class FaultAction(enum.Enum):
    """What a rule does when it matches."""

    RAISE = "raise"
    DELAY = "delay"
    DROP = "drop"
    CALL = "call"


# (site, action) -> the step kinds a rule may name.
_ALLOWED: dict[tuple[FaultSite, FaultAction], frozenset[StepKind]] = {
    (FaultSite.COMPUTE, FaultAction.RAISE): RUNS_MODULE_KINDS | {TIED_GRAD_SUM},
    (FaultSite.COMPUTE, FaultAction.DELAY): RUNS_MODULE_KINDS | {TIED_GRAD_SUM},
    (FaultSite.COMPUTE, FaultAction.CALL): frozenset(StepKind),
    (FaultSite.COPY, FaultAction.RAISE): SWAP_LAUNCH_KINDS,
    (FaultSite.COPY, FaultAction.DELAY): SWAP_LAUNCH_KINDS,
    (FaultSite.P2P, FaultAction.RAISE): P2P_KINDS,
    (FaultSite.P2P, FaultAction.DELAY): P2P_KINDS,
    (FaultSite.P2P, FaultAction.DROP): SEND_KINDS,
}


def _check_optional_index(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 0 or None (any), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0 or None (any), got {value!r}")


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault: at ``site``, for steps of ``kind`` (and rank/stage/micro), do ``action``.

    ``delay_s`` is the delay of a ``DELAY`` rule (finite, > 0); ``callback`` the function a
    ``CALL`` rule runs. Use the constructors (``fail_compute``, ``delay_copy``, ...) rather
    than building rules by hand; every combination is checked here all the same.
    """

    site: FaultSite
    action: FaultAction
    kind: StepKind
    rank: int | None = None
    stage: int | None = None
    micro: int | None = None
    delay_s: float = 0.0
    callback: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.site, FaultSite):
            raise TypeError(f"site must be a FaultSite, got {self.site!r}")
        if not isinstance(self.action, FaultAction):
            raise TypeError(f"action must be a FaultAction, got {self.action!r}")
        if not isinstance(self.kind, StepKind):
            raise TypeError(f"kind must be a StepKind, got {self.kind!r}")
        allowed = _ALLOWED.get((self.site, self.action))
        if allowed is None:
            actions = sorted(a.value for s, a in _ALLOWED if s is self.site)
            raise ValueError(
                f"action {self.action.value!r} is not available at site {self.site.value!r}; "
                f"allowed: {', '.join(actions)}"
            )
        if self.kind not in allowed:
            raise ValueError(
                f"kind must be one of {', '.join(sorted(k.value for k in allowed))} for a "
                f"{self.action.value} rule at site {self.site.value!r}, got {self.kind.value}"
            )
        for name in ("rank", "stage", "micro"):
            _check_optional_index(name, getattr(self, name))
        if self.action is FaultAction.DELAY:
            delay = self.delay_s
            if isinstance(delay, bool) or not isinstance(delay, int | float):
                raise TypeError(f"delay_s must be a number of seconds > 0, got {delay!r}")
            if not (delay > 0 and math.isfinite(delay)):
                raise ValueError(f"delay_s must be a finite number of seconds > 0, got {delay!r}")
        if (self.action is FaultAction.CALL) != (self.callback is not None):
            raise ValueError(
                "callback must be given for a CALL rule and only for it, got "
                f"action={self.action.value!r}, callback={self.callback!r}"
            )
        if self.callback is not None and not callable(self.callback):
            raise TypeError(f"callback must be callable, got {self.callback!r}")

    def matches(self, site: FaultSite, rank: int, step: MetaStep) -> bool:
        return (
            site is self.site
            and step.kind is self.kind
            and (self.rank is None or self.rank == rank)
            and (self.stage is None or self.stage == step.stage)
            and (self.micro is None or self.micro == step.micro)
        )

    def describe(self, rank: int, step: MetaStep) -> str:
        return f"injected {self.action.value} at {self.site.value} of rank {rank}, {step.short()}"

    def raise_fault(self, rank: int, step: MetaStep) -> None:
        """Raise the rule's :class:`InjectedFault` (any thread)."""
        raise InjectedFault(self.describe(rank, step))


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The faults of one run: an ordered tuple of :class:`FaultRule` (first match wins)."""

    rules: tuple[FaultRule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rules, tuple):
            raise TypeError(f"rules must be a tuple of FaultRule, got {self.rules!r}")
        for rule in self.rules:
            if not isinstance(rule, FaultRule):
                raise TypeError(f"rules must hold FaultRule objects, got {rule!r}")

    def covers(self, site: FaultSite) -> bool:
        """Whether any rule applies at ``site``."""
        return any(rule.site is site for rule in self.rules)

    def match(self, site: FaultSite, rank: int, step: MetaStep) -> FaultRule | None:
        """The first rule for ``step`` served by ``site`` on ``rank``, or None."""
        for rule in self.rules:
            if rule.matches(site, rank, step):
                return rule
        return None


@dataclass(frozen=True, slots=True)
class ComputeFaults:
    """The COMPUTE rules of ``plan`` for ``rank``, as its compute actor applies them
    (module docstring); ``note(event)`` records what fired in the flight recorder."""

    plan: FaultPlan
    rank: int
    note: Callable[[str], None]

    def wrap(self, step: MetaStep, body: Callable[[], Any]) -> Callable[[], Any]:
        """``body`` (the compute-thread work of ``step``), or, under a RAISE or DELAY rule
        for the step, ``body`` behind that fault (raised or slept on the thread)."""
        rule = self.plan.match(FaultSite.COMPUTE, self.rank, step)
        if rule is None or rule.action is FaultAction.CALL:
            return body
        return partial(_faulted, rule, self.rank, step, self.note, body)

    def stops(self, step: MetaStep) -> bool:
        """Whether a CALL rule matches ``step`` or one of its sub-steps."""
        return any(rule is not None for rule in self._calls(step))

    def call_before(self, step: MetaStep) -> bool:
        """Event loop, before ``step``: run the callbacks of the CALL rules of it and its
        sub-steps; whether any ran."""
        ran = False
        for leaf, rule in zip((step, *step.sub_steps), self._calls(step), strict=True):
            if rule is not None and rule.callback is not None:
                self.note(rule.describe(self.rank, leaf))
                rule.callback()
                ran = True
        return ran

    def _calls(self, step: MetaStep) -> list[FaultRule | None]:
        rules = [self.plan.match(FaultSite.COMPUTE, self.rank, s) for s in (step, *step.sub_steps)]
        return [r if r is not None and r.action is FaultAction.CALL else None for r in rules]


def _faulted(
    rule: FaultRule,
    rank: int,
    step: MetaStep,
    note: Callable[[str], None],
    body: Callable[[], Any],
) -> Any:
    """Compute thread: the rule's fault, then (after a delay) ``body()``."""
    note(rule.describe(rank, step))
    if rule.action is FaultAction.RAISE:
        rule.raise_fault(rank, step)
    time.sleep(rule.delay_s)
    return body()


Direction = Literal["offload", "load"]


def _copy_kind(direction: Direction) -> StepKind:
    if direction == "offload":
        return StepKind.SWAP_LAUNCH_OFFLOAD
    if direction == "load":
        return StepKind.SWAP_LAUNCH_LOAD
    raise ValueError(f"direction must be 'offload' or 'load', got {direction!r}")


def fail_compute(
    kind: StepKind = StepKind.FWD,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Raise on the compute thread when ``kind`` (FWD/BWD/...) of (stage, micro) starts."""
    return FaultRule(FaultSite.COMPUTE, FaultAction.RAISE, kind, rank, stage, micro)


def delay_compute(
    seconds: float,
    kind: StepKind = StepKind.FWD,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Block the compute thread for ``seconds`` before ``kind`` of (stage, micro)."""
    return FaultRule(
        FaultSite.COMPUTE, FaultAction.DELAY, kind, rank, stage, micro, delay_s=seconds
    )


def call_at(
    callback: Callable[[], None],
    kind: StepKind,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Run ``callback()`` on the event loop when the compute actor reaches the step."""
    return FaultRule(
        FaultSite.COMPUTE, FaultAction.CALL, kind, rank, stage, micro, callback=callback
    )


def fail_copy(
    direction: Direction = "offload",
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Fail the offload (or load) copy of chunk (stage, micro) on the copy stream."""
    return FaultRule(FaultSite.COPY, FaultAction.RAISE, _copy_kind(direction), rank, stage, micro)


def delay_copy(
    seconds: float,
    direction: Direction = "offload",
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Hold the copy stream for ``seconds`` before the offload (or load) of a chunk."""
    return FaultRule(
        FaultSite.COPY,
        FaultAction.DELAY,
        _copy_kind(direction),
        rank,
        stage,
        micro,
        delay_s=seconds,
    )


def fail_p2p(
    kind: StepKind = StepKind.SEND_F,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Fail a send or a receive (``kind`` SEND_F/SEND_B/RECV_F/RECV_B) in the P2P actor."""
    return FaultRule(FaultSite.P2P, FaultAction.RAISE, kind, rank, stage, micro)


def delay_message(
    seconds: float,
    kind: StepKind = StepKind.SEND_F,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Deliver a message ``seconds`` late (a SEND_*), or post a receive late (a RECV_*)."""
    return FaultRule(FaultSite.P2P, FaultAction.DELAY, kind, rank, stage, micro, delay_s=seconds)


def drop_message(
    kind: StepKind = StepKind.SEND_F,
    *,
    rank: int | None = None,
    stage: int | None = None,
    micro: int | None = None,
) -> FaultRule:
    """Lose a sent message: the sender sees success, the receiver never gets it."""
    return FaultRule(FaultSite.P2P, FaultAction.DROP, kind, rank, stage, micro)
