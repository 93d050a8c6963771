"""The compute actor's jobs that are not its own steps' bodies.

A batch (``ppswap.actors.batch``) may hold jobs that serve a step without being one:
the install of FSDP's gathered parameters before a leaf, and a TIED_GRAD_SUM's gather
job. :data:`NOT_STEPS` names their kinds. The batch hooks (``BatchHooks``) that make
FSDP's and the tie sum's jobs are module functions over the actor's step errors, bound
with ``functools.partial``, never the actor's bound methods (that would make a cycle
actor -> local steps -> hooks -> actor, left to the garbage collector). Each names the
step in the error it raises. :func:`steps_ran` turns what a batch ran into the spans of
its steps, the serving jobs folded into the gap or the step they serve.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.actors.batch import BatchOutcome, StepJob
from ppswap.actors.failures import StepFailures
from ppswap.actors.tie_sum import TIE_GATHER_JOB, TieRankDriver
from ppswap.fsdp.driver import FsdpRankDriver
from ppswap.scheduler.steps import MetaStep

__all__ = [
    "FSDP_INSTALL",
    "FSDP_STEP",
    "NOT_STEPS",
    "fsdp_job",
    "install_job",
    "steps_ran",
    "tie_jobs",
]

FSDP_STEP = "fsdp_step"
"""The kind of an FSDP_UNSHARD / FSDP_RESHARD job."""
FSDP_INSTALL = "fsdp_install"
"""The kind of the install of gathered parameters before a leaf: not a step."""
NOT_STEPS = frozenset({FSDP_INSTALL, TIE_GATHER_JOB})
"""Kinds of jobs that serve the step after them, not steps of the order."""


def fsdp_job(errors: StepFailures, fsdp: FsdpRankDriver, step: MetaStep) -> StepJob:
    """FSDP's job for ``step``; an error names the step."""
    try:
        made = fsdp.job(step)
    except Exception as exc:
        raise errors.named(step, exc) from exc
    return StepJob(made.step, FSDP_STEP, made.run, arrival=made.arrival)


def install_job(errors: StepFailures, fsdp: FsdpRankDriver, leaf: MetaStep) -> StepJob | None:
    """The install of gathered parameters ``leaf`` needs first, if any; an error names
    the leaf."""
    try:
        made = fsdp.install_before(leaf)
    except Exception as exc:
        raise errors.named(leaf, exc) from exc
    if made is None:
        return None
    return StepJob(made.step, FSDP_INSTALL, made.run, arrival=made.arrival)


def tie_jobs(errors: StepFailures, ties: TieRankDriver, step: MetaStep) -> Sequence[StepJob]:
    """The tie sum's jobs for a TIED_GRAD_SUM; an error names the step."""
    try:
        return ties.jobs(step)
    except Exception as exc:
        raise errors.named(step, exc) from exc


def steps_ran(
    jobs: Sequence[StepJob],
    ran_indices: Sequence[int],
    outcome: BatchOutcome,
    posted: Sequence[tuple[int, MetaStep]],
) -> tuple[list[MetaStep], BatchOutcome, Sequence[tuple[int, MetaStep]]]:
    """The steps a batch ran, their outcome and the posts between them, without the jobs
    that are not steps: an FSDP install is drawn as part of the gap before the leaf it
    serves, a TIED_GRAD_SUM's gather job as part of the step's span (from the gather to
    the sum's end). ``posted`` pairs a post with the number of jobs that ran before it."""
    kept = [n for n, index in enumerate(ran_indices) if jobs[index].kind not in NOT_STEPS]
    if len(kept) < len(ran_indices):
        before = [0] * (len(ran_indices) + 1)  # jobs not steps among the first n that ran
        for n, index in enumerate(ran_indices):
            before[n + 1] = before[n] + (jobs[index].kind in NOT_STEPS)
        posted = [(n - before[n], step) for n, step in posted]
        started = [outcome.started[n] for n in kept]
        seconds = [outcome.seconds[n] for n in kept]
        for position, n in enumerate(kept):
            if n and jobs[ran_indices[n - 1]].kind == TIE_GATHER_JOB:
                begin = outcome.started[n - 1]
                seconds[position] += started[position] - begin
                started[position] = begin
        outcome = BatchOutcome([outcome.results[n] for n in kept], started, seconds, outcome.error)
    return [jobs[ran_indices[n]].step for n in kept], outcome, posted
