"""Bad input is refused with a clear error before any compute starts; forward-only runs.

"Before compute starts" is checked by replacing the runtime's thread class with one that
fails the test if it is ever constructed: every refusal here happens in ``prepare_run``.
What only the model can reveal (a feature shape the first layer rejects, a loss_fn that
misbehaves) is reported at the first FWD, named by rank, actor and step, and the stages
run again afterwards.
"""

from __future__ import annotations

import gc
import math
from dataclasses import replace
from typing import Any

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops
from reliability_support import (
    GPIPE,
    Case,
    assert_same_grads,
    failure_of,
    grads_of,
    make_data,
    make_stages,
    other_tasks,
    ppswap_threads,
    reference,
    run_case,
    swap_object_counts,
)
from stage_runs import stage_runs_holding_chunks

import ppswap.actors.runtime as runtime
from ppswap import PipelineInputError, PipelineStage, run_schedule
from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import EmulatedDevice
from ppswap.swap.manager import ResidentTensor


class _NoThreads:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("compute started although the input is bad")


@pytest.fixture
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "DedicatedThread", _NoThreads)


X, Y = make_data()
STAGES = make_stages(2)
OTHER_STAGES = make_stages(4)


def _kwargs(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "micro_batch_num": 4,
        "inputs": X,
        "targets": Y,
        "loss_fn": mse_loss,
        "swap": True,
    }
    return base | overrides


class _ForeignModule:
    """A callable module of no supported framework (neither MindSpore nor torch)."""

    def __call__(self, x: Any) -> Any:
        return x


# (id, stages, schedule, kwargs, error type, message fragment)
BAD_INPUTS: list[tuple[str, list[Any], Any, dict[str, Any], type[Exception], str]] = [
    ("float64 inputs", STAGES, "gpipe", _kwargs(inputs=X.astype(np.float64)),
     PipelineInputError, "inputs must have dtype float32"),
    ("object inputs", STAGES, "gpipe", _kwargs(inputs=X.astype(object)),
     PipelineInputError, "inputs must hold numbers"),
    ("string targets", STAGES, "gpipe", _kwargs(targets=np.full((8, 8), "a")),
     PipelineInputError, "targets must hold numbers"),
    ("list inputs", STAGES, "gpipe", _kwargs(inputs=X.tolist()),
     PipelineInputError, "inputs must be a mindspore.Tensor or numpy.ndarray, got list"),
    ("scalar inputs", STAGES, "gpipe", _kwargs(inputs=np.array(1.0, np.float32)),
     PipelineInputError, "inputs must have a batch dimension"),
    ("empty batch", STAGES, "gpipe",
     _kwargs(inputs=np.zeros((0, 8), np.float32), targets=np.zeros((0, 8), np.float32)),
     PipelineInputError, "inputs must not be empty"),
    ("batch not divisible", STAGES, "gpipe", _kwargs(inputs=X[:6], targets=Y[:6]),
     PipelineInputError, "batch size 6 (shape (6, 8)) must be divisible by micro_batch_num=4"),
    ("fewer samples than micro-batches", STAGES, "gpipe", _kwargs(micro_batch_num=16),
     PipelineInputError, "must be divisible by micro_batch_num=16"),
    ("batch sizes differ", STAGES, "gpipe", _kwargs(targets=np.concatenate([Y, Y])),
     PipelineInputError, "inputs and targets must have the same batch size, got 8 and 16"),
    ("tensor inputs of the wrong dtype", STAGES, "gpipe",
     _kwargs(inputs=Tensor(X.astype(np.float16))),
     PipelineInputError, "must have dtype float32 (the first stage's parameters), got float16"),
    ("a stage missing", STAGES[:1], "gpipe", _kwargs(),
     ValueError, "stages must cover stage indices [0, 1] exactly once"),
    ("a stage twice", [STAGES[0], STAGES[0]], "gpipe", _kwargs(),
     ValueError, "stages must not repeat a stage index"),
    ("stage_num disagrees", [STAGES[0], OTHER_STAGES[1]], "gpipe", _kwargs(),
     ValueError, "stages must agree on stage_num"),
    ("not stages", ["stage0", "stage1"], "gpipe", _kwargs(),
     TypeError, "stages must hold PipelineStage objects, got str"),
    ("no stages", [], "gpipe", _kwargs(), TypeError, "stages must be a non-empty list"),
    ("loss_fn missing", STAGES, "gpipe", _kwargs(loss_fn=None),
     TypeError, "loss_fn must be a callable (output, target) -> scalar loss"),
    ("loss_fn not callable", STAGES, "gpipe", _kwargs(loss_fn="mse"),
     TypeError, "loss_fn must be a callable"),
    ("targets missing", STAGES, "gpipe", _kwargs(targets=None),
     PipelineInputError, "targets must be given with loss_fn"),
    ("forward-only with swap", STAGES, "gpipe", _kwargs(forward_only=True),
     ValueError, "swap must be False for a forward-only run"),
    ("forward_only not a bool", STAGES, "gpipe", _kwargs(swap=False, forward_only="yes"),
     TypeError, "forward_only must be a bool"),
    ("count_saved_bytes not a bool", STAGES, "gpipe", _kwargs(swap=False, count_saved_bytes=1),
     TypeError, "count_saved_bytes must be a bool"),
    ("unknown schedule", STAGES, "pipedream", _kwargs(),
     ValueError, "schedule must be one of gpipe, 1f1b, interleaved_1f1b, looped_bfs, "
     "interleaved_zb, zbv, dualpipev, got 'pipedream'"),
    ("schedule not a string", STAGES, 3, _kwargs(), TypeError, "schedule must be one of"),
    ("unknown p2p", STAGES, "gpipe", _kwargs(p2p="udp"), ValueError, "p2p must be one of"),
    ("swap not a bool", STAGES, "gpipe", _kwargs(swap="yes"), TypeError, "swap must be a bool"),
    ("micro_batch_num 0", STAGES, "gpipe", _kwargs(micro_batch_num=0),
     ValueError, "micro_batch_num must be an int >= 1, got 0"),
    ("micro_batch_num a string", STAGES, "gpipe", _kwargs(micro_batch_num="4"),
     TypeError, "micro_batch_num must be an int >= 1"),
    ("micro_batch_num a bool", STAGES, "gpipe", _kwargs(micro_batch_num=True),
     TypeError, "micro_batch_num must be an int >= 1"),
    ("negative step_timeout", STAGES, "gpipe", _kwargs(step_timeout=-1),
     ValueError, "step_timeout must be a number of seconds > 0"),
    ("nan step_timeout", STAGES, "gpipe", _kwargs(step_timeout=math.nan),
     ValueError, "step_timeout must be a number of seconds > 0"),
    ("step_timeout a string", STAGES, "gpipe", _kwargs(step_timeout="10"),
     TypeError, "step_timeout must be a number of seconds > 0"),
    ("loss_scale 0", STAGES, "gpipe", _kwargs(loss_scale=0),
     ValueError, "loss_scale must be a finite number > 0, got 0"),
    ("nan loss_scale", STAGES, "gpipe", _kwargs(loss_scale=math.nan),
     ValueError, "loss_scale must be a finite number > 0, got nan"),
    ("inf loss_scale", STAGES, "gpipe", _kwargs(loss_scale=math.inf),
     ValueError, "loss_scale must be a finite number > 0, got inf"),
    ("loss_scale a bool", STAGES, "gpipe", _kwargs(loss_scale=True),
     TypeError, "loss_scale must be a finite number > 0, got True"),
    ("pp does not divide", OTHER_STAGES, "gpipe", _kwargs(pp=3),
     ValueError, "pp must divide stage_num=4"),
    ("pp a string", OTHER_STAGES, "gpipe", _kwargs(pp="2"), TypeError, "pp must be an int"),
    ("interleaved without pp", OTHER_STAGES, "interleaved_1f1b", _kwargs(),
     ValueError, "pp must be given for interleaved_1f1b"),
    ("interleaved micro not a multiple of pp", OTHER_STAGES, "interleaved_1f1b",
     _kwargs(pp=2, micro_batch_num=3, inputs=X[:6], targets=Y[:6]),
     ValueError, "micro must be a multiple of pp=2"),
    ("1f1b with stages per rank", OTHER_STAGES, "1f1b", _kwargs(pp=2),
     ValueError, "vpp must be 1 for schedule '1f1b'"),
    ("gpipe with overlap", STAGES, "gpipe", _kwargs(overlap_b_f=True),
     ValueError, "schedule 'gpipe' has none"),
    ("split_dw not a bool", STAGES, "1f1b", _kwargs(split_dw="no"),
     TypeError, "split_dw must be a bool"),
    ("min_swap_gap 1", STAGES, "gpipe", _kwargs(min_swap_gap=1),
     ValueError, "min_swap_gap must be an int >= 2"),
    ("swap_min_bytes negative", STAGES, "gpipe", _kwargs(swap_min_bytes=-1),
     ValueError, "swap_min_bytes must be an int >= 0, got -1"),
    ("swap_min_bytes a float", STAGES, "gpipe", _kwargs(swap_min_bytes=4096.0),
     TypeError, "swap_min_bytes must be an int >= 0, got 4096.0"),
    ("faults not a plan", STAGES, "gpipe", _kwargs(faults="boom"),
     TypeError, "faults must be a ppswap.core.faults.FaultPlan or None, got str"),
    ("trace not a path", STAGES, "gpipe", _kwargs(trace=5),
     TypeError, "trace must be a file path"),
    ("device not a copy engine", STAGES, "gpipe", _kwargs(device=object()),
     TypeError, "device must implement CopyEngine"),
    ("transport not a transport", STAGES, "gpipe", _kwargs(transport=object()),
     TypeError, "transport must implement ppswap's Transport protocol"),
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.asyncio
@pytest.mark.usefixtures("no_compute")
@pytest.mark.parametrize(
    ("stages", "schedule", "kwargs", "error", "fragment"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
async def test_bad_input_is_refused_before_compute(
    stages: list[Any],
    schedule: Any,
    kwargs: dict[str, Any],
    error: type[Exception],
    fragment: str,
) -> None:
    with pytest.raises(error) as caught:
        await run_schedule(stages, schedule, **kwargs)
    assert fragment in str(caught.value)
    assert all(s.generation == 0 for s in STAGES + OTHER_STAGES)


def test_a_module_of_no_supported_framework_is_refused() -> None:
    with pytest.raises(
        TypeError,
        match=r"module must be a mindspore\.nn\.Cell or a torch\.nn\.Module, got "
        r"\S*_ForeignModule",
    ):
        PipelineStage(_ForeignModule(), 0, 1)  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.usefixtures("no_compute")
async def test_a_module_swapped_for_a_foreign_one_is_refused() -> None:
    stages = make_stages(2)
    stages[1].module = _ForeignModule()  # type: ignore[assignment]
    with pytest.raises(
        TypeError, match=r"stage 1's module must be a mindspore\.nn\.Cell \(the framework"
    ):
        await run_schedule(stages, "gpipe", **_kwargs())


@pytest.mark.asyncio
@pytest.mark.usefixtures("no_compute")
async def test_graph_mode_is_refused() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(ValueError, match=r"must be PYNATIVE_MODE .* got GRAPH_MODE"):
            await run_schedule(make_stages(2), "gpipe", **_kwargs())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def _non_scalar_loss(output: Tensor, target: Tensor) -> Tensor:
    return (output - target) ** 2


def _float_loss(output: Tensor, target: Tensor) -> float:
    return 1.0


# (id, run overrides, error type of the cause, message fragment of the cause)
FIRST_FWD_ERRORS = [
    ("non-scalar loss", {"loss_fn": _non_scalar_loss}, PipelineInputError,
     "loss_fn _non_scalar_loss must return a scalar mindspore.Tensor (shape ()), got Tensor "
     "of shape (2, 8)"),
    ("loss not a tensor", {"loss_fn": _float_loss}, PipelineInputError,
     "loss_fn _float_loss must return a scalar mindspore.Tensor (shape ()), got float"),
    ("loss_fn raises on the target", {"targets": np.ones((8, 3), np.float32)},
     PipelineInputError, "loss_fn mse_loss raised ValueError on an output of shape (2, 8) and "
     "a target of shape (2, 3)"),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("overrides", "cause", "fragment"),
    [case[1:] for case in FIRST_FWD_ERRORS],
    ids=[case[0] for case in FIRST_FWD_ERRORS],
)
async def test_a_bad_loss_fn_is_named_at_the_first_forward(
    overrides: dict[str, Any], cause: type[Exception], fragment: str
) -> None:
    _, expected_grads = await reference(GPIPE)
    stages = make_stages(2)
    failure = await failure_of(run_case(stages, GPIPE, **overrides))
    assert (failure.rank, failure.actor, failure.step) == (1, "compute", "F0.1")
    assert failure.cause_type is cause
    assert fragment in failure.cause_message
    assert fragment in failure.message
    await run_case(stages, GPIPE)
    assert_same_grads(expected_grads, grads_of(stages))


class _Pair(nn.Cell):
    """Returns its inner cell's output and its input: two tensors, to a stage that takes
    one."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.inner(x), x


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_tuple_the_next_stage_cannot_take_is_named_at_its_first_forward() -> None:
    stages = make_stages(2)
    paired = [PipelineStage(_Pair(stages[0].module), 0, 2), stages[1]]
    failure = await failure_of(run_case(paired, GPIPE))
    assert (failure.rank, failure.actor, failure.step) == (1, "compute", "F0.1")
    assert failure.cause_type is PipelineInputError
    assert "stage 1's module raised TypeError when called with the 2 tensors stage 0 returned" in (
        failure.cause_message
    )


class _Dict(nn.Cell):
    """Returns a dict: nothing the next stage could be called with."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner

    def construct(self, x: Tensor) -> dict[str, Tensor]:
        return {"hidden": self.inner(x)}


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_stage_that_returns_a_dict_is_named_at_its_first_forward() -> None:
    stages = make_stages(2)
    keyed = [PipelineStage(_Dict(stages[0].module), 0, 2), stages[1]]
    failure = await failure_of(run_case(keyed, GPIPE))
    assert (failure.rank, failure.actor, failure.step) == (0, "compute", "F0.0")
    assert failure.cause_type is PipelineInputError
    assert "stage 0's module must return a mindspore.Tensor or a tuple" in failure.cause_message
    assert "got dict" in failure.cause_message


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_feature_shape_the_model_rejects_fails_at_the_first_forward() -> None:
    stages = make_stages(2)
    failure = await failure_of(run_case(stages, GPIPE, inputs=np.ones((8, 7), np.float32)))
    assert (failure.rank, failure.actor, failure.step) == (0, "compute", "F0.0")
    assert failure.cause_type is ValueError
    assert "MatMul" in failure.message


class _Flaky(nn.Cell):
    """Runs its inner cell, then raises when ``fail`` is set: an error mid-graph."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner
        self.fail = False

    def construct(self, x: Tensor) -> Tensor:
        out: Tensor = self.inner(x)
        if self.fail:
            raise RuntimeError("injected failure in the middle of the stage's forward")
        return ops.tanh(out) * 0.0 + out  # more graph after the failure point


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_forward_failing_mid_graph_does_not_poison_the_next_run() -> None:
    def flaky_stages() -> list[PipelineStage]:
        modules = build_mlp_stages(2, dim=8, wrap=None)
        return [PipelineStage(_Flaky(m), i, 2) for i, m in enumerate(modules)]

    reference_stages = flaky_stages()
    await run_case(reference_stages, GPIPE)
    expected = grads_of(reference_stages)

    stages = flaky_stages()
    device = EmulatedDevice()
    stages[1].module.fail = True  # type: ignore[attr-defined]
    failure = await failure_of(run_case(stages, GPIPE, device=device))
    assert (failure.rank, failure.actor, failure.step) == (1, "compute", "F0.1")
    assert failure.cause_type is RuntimeError
    assert ppswap_threads() == [] and other_tasks() == set()
    assert stage_runs_holding_chunks() == 0
    assert device.pool_stats().lent == 0
    stages[1].module.fail = False  # type: ignore[attr-defined]
    await run_case(stages, GPIPE, device=device)
    assert_same_grads(expected, grads_of(stages))


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_forwards_failing_mid_graph_without_swap_retain_nothing() -> None:
    """MindSpore keeps what the saved-tensor hooks packed during a forward that raised.
    Without a swap group those are ResidentTensor handles, emptied when the forward fails:
    neither the chunk's activations nor (through the hook) its session stay alive."""
    modules = build_mlp_stages(2, dim=8, wrap=None)
    stages = [PipelineStage(_Flaky(m), i, 2) for i, m in enumerate(modules)]
    _, sessions_before = swap_object_counts()
    earlier = _holding_resident_handles()  # other tests' (kept alive, so ids stay unique)
    stages[1].module.fail = True  # type: ignore[attr-defined]
    for _ in range(3):
        await failure_of(run_case(stages, replace(GPIPE, swap=False)))
    gc.collect()
    _, sessions_after = swap_object_counts()
    assert sessions_after <= sessions_before + 1  # bounded, not one per failure
    known = {id(handle) for handle in earlier}
    assert [h for h in _holding_resident_handles() if id(h) not in known] == []


def _holding_resident_handles() -> list[ResidentTensor]:
    return [o for o in gc.get_objects() if type(o) is ResidentTensor and o.tensor is not None]


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize("p2p", ["plain", "boundary"])
async def test_forward_only_returns_the_losses_and_leaves_gradients_alone(
    p2p: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = Case(schedule="1f1b", pp=2, stage_num=2, micro=4, swap=False, p2p=p2p)
    expected_losses, _ = await reference(case)
    stages = make_stages(2)
    await run_case(stages, case)
    trained = grads_of(stages)

    def no_recording(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a forward-only run recorded a graph")

    monkeypatch.setattr(MINDSPORE.autograd, "record", no_recording)
    result = await run_case(stages, case, forward_only=True)
    assert result.losses == expected_losses
    assert stage_runs_holding_chunks() == 0
    assert_same_grads(trained, grads_of(stages))  # untouched by the forward-only run


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "micro"), [("1f1b", 1), ("1f1b", 2), ("gpipe", 1)])
async def test_fewer_micro_batches_than_stages_runs_without_hanging(
    schedule: str, micro: int
) -> None:
    case = Case(schedule=schedule, pp=4, stage_num=4, micro=micro)
    stages = make_stages(4)
    x, y = make_data(batch=micro * 2)
    result = await run_schedule(
        stages,
        schedule,
        inputs=x,
        targets=y,
        step_timeout=30.0,
        **(case.kwargs() | {"swap": True}),
    )
    assert len(result.losses) == micro
    assert all(np.isfinite(g).all() for g in grads_of(stages))
