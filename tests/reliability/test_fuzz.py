"""Fuzz: random bad configurations and inputs each get a clear error; none hangs or crashes.

A valid run (one of the three schedule families) is spoiled by one to three random
mutations, each drawn from values that are wrong for that parameter whatever the others
are. The run must raise TypeError or ValueError (PipelineInputError is a ValueError)
before any compute starts, with a message naming one of the spoiled parameters, within a
deadline. Inputs only the model can reject (integer features into a float layer, a
feature width the first layer does not take) must end as a PipelineError naming rank,
actor and step, caused by MindSpore's TypeError/ValueError. The process survives them all.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import (
    Failure,
    failure_of,
    make_data,
    make_stages,
    ppswap_threads,
    run_in_fresh_loop,
)

import ppswap.actors.runtime as runtime
from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import mse_loss

pytestmark = pytest.mark.slow

STAGES_2 = make_stages(2)
STAGES_4 = make_stages(4)
X, Y = make_data()

# (schedule, stages, pp): valid bases.
BASES = [("gpipe", STAGES_2, None), ("1f1b", STAGES_2, 2), ("interleaved_1f1b", STAGES_4, 2)]

not_bool = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats())
not_int = st.one_of(st.floats(), st.text(max_size=3), st.none(), st.booleans())


def _bad_array(batch: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(np.zeros((batch, 8), np.float64)),
        st.just(np.zeros((batch, 8), np.float16)),
        st.just(np.zeros((batch, 8), np.complex64)),
        st.just(np.full((batch, 8), "x")),
        st.just(np.zeros((batch, 8), object)),
        st.just(np.zeros((0, 8), np.float32)),
        st.just(np.float32(1.0)),
        st.just(np.array(1.0, np.float32)),
        st.integers(1, 40).filter(lambda b: b % 4 != 0).map(lambda b: np.zeros((b, 8), np.float32)),
        st.builds(lambda: [[0.0] * 8] * batch),
        st.text(max_size=4),
        st.none(),
    )


def _bad_stages(stages: list[PipelineStage]) -> st.SearchStrategy[Any]:
    other = STAGES_4 if len(stages) == 2 else STAGES_2
    return st.one_of(
        st.just(stages[:-1]),
        st.just(stages[1:]),
        st.just([*stages, stages[0]]),
        st.just([stages[0], *other[1:]]),
        st.just([]),
        st.just(["stage"] * len(stages)),
        st.just(stages[0].module),
        st.integers(),
    )


# parameter -> (strategy of wrong values, words one of which the message must hold)
MUTATIONS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "micro_batch_num": (st.one_of(st.integers(max_value=0), not_int), ("micro_batch_num",)),
    "schedule": (
        st.one_of(st.text(max_size=12), st.integers(), st.none()).filter(
            lambda s: s not in ("gpipe", "1f1b", "interleaved_1f1b")
        ),
        ("schedule",),
    ),
    "p2p": (
        st.one_of(st.text(max_size=8), st.integers(), st.none()).filter(
            lambda s: s not in ("plain", "batch", "boundary")
        ),
        ("p2p",),
    ),
    "swap": (not_bool, ("swap",)),
    "split_dw": (not_bool, ("split_dw",)),
    "overlap_b_f": (not_bool, ("overlap_b_f",)),
    "forward_only": (st.one_of(not_bool, st.just(True)), ("forward_only", "forward-only")),
    "step_timeout": (
        st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.text(max_size=3), st.none()),
        ("step_timeout",),
    ),
    "loss_scale": (
        st.one_of(
            st.floats(max_value=0.0),
            st.sampled_from([math.nan, math.inf]),
            st.text(max_size=3),
            st.none(),
            st.booleans(),
        ),
        ("loss_scale",),
    ),
    "pp": (st.one_of(st.integers(max_value=0), st.text(max_size=2), st.floats()), ("pp",)),
    "min_swap_gap": (st.one_of(st.integers(max_value=1), not_int), ("min_swap_gap",)),
    "loss_fn": (st.one_of(st.none(), st.integers(), st.text(max_size=3)), ("loss_fn",)),
    "inputs": (_bad_array(8), ("inputs",)),
    "targets": (
        st.one_of(_bad_array(8), st.just(np.zeros((16, 8), np.float32))),
        ("targets",),
    ),
    "faults": (st.one_of(st.integers(), st.text(max_size=3), st.just(object())), ("faults",)),
    "trace": (st.one_of(st.integers(), st.floats(), st.just(object())), ("trace",)),
    "device": (st.one_of(st.integers(), st.text(max_size=3), st.just(object())), ("device",)),
    "stages": (None, ("stages",)),  # drawn from the base's stages
}


class _NoThreads:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("compute started although the input is bad")


@pytest.mark.timeout(600)
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_bad_configurations_get_a_clear_error(
    data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "DedicatedThread", _NoThreads)
    schedule, stages, pp = data.draw(st.sampled_from(BASES), label="base")
    kwargs: dict[str, Any] = {
        "micro_batch_num": 4,
        "inputs": X,
        "targets": Y,
        "loss_fn": mse_loss,
        "swap": True,
        "pp": pp,
        "step_timeout": 30.0,
    }
    call_stages: Any = stages
    call_schedule: Any = schedule
    names = data.draw(
        st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True),
        label="spoiled",
    )
    for name in names:
        strategy = MUTATIONS[name][0]
        if name == "stages":
            call_stages = data.draw(_bad_stages(stages), label="stages")
        elif name == "schedule":
            call_schedule = data.draw(strategy, label="schedule")
        elif name == "forward_only":
            value = data.draw(strategy, label="forward_only")
            kwargs["forward_only"] = value
            if value is True:
                kwargs["swap"] = True  # forward-only with swap: refused
        else:
            kwargs[name] = data.draw(strategy, label=name)
    words = tuple(word for name in names for word in MUTATIONS[name][1])

    async def attempt() -> BaseException | None:
        with anyio.fail_after(30):
            try:
                await run_schedule(call_stages, call_schedule, **kwargs)
            except Exception as error:  # what it raised, checked below
                return error
        return None

    error = run_in_fresh_loop(attempt)
    assert error is not None, f"accepted a bad configuration: {names}"
    assert isinstance(error, TypeError | ValueError), repr(error)
    message = str(error)
    assert any(word in message for word in words), f"{message!r} names none of {words}"
    assert all(s.generation == 0 for s in STAGES_2 + STAGES_4)


@pytest.mark.timeout(300)
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    features=st.one_of(
        st.integers(1, 16)
        .filter(lambda width: width != 8)
        .map(lambda width: np.ones((8, width), np.float32)),
        st.sampled_from([np.int32, np.int64, np.bool_]).map(lambda t: np.ones((8, 8), t)),
    )
)
def test_inputs_only_the_model_rejects_fail_at_the_first_forward(features: np.ndarray) -> None:
    async def attempt() -> Failure:
        stages = make_stages(2)
        with anyio.fail_after(60):
            return await failure_of(
                run_schedule(
                    stages,
                    "gpipe",
                    micro_batch_num=4,
                    inputs=features,
                    targets=Y,
                    loss_fn=mse_loss,
                    swap=True,
                    step_timeout=30.0,
                )
            )

    failure = run_in_fresh_loop(attempt)
    assert (failure.rank, failure.actor, failure.step) == (0, "compute", "F0.0")
    assert failure.cause_type in (TypeError, ValueError)
    assert ppswap_threads() == []
