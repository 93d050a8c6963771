"""bfloat16 models on the torch backend.

numpy has no bfloat16, and the runtime moves batches, losses, P2P payloads between
processes and FSDP shards through numpy: the torch backend carries a bfloat16 tensor as
``ml_dtypes``' bfloat16 array (the same bytes, no copy; ``ppswap.core.dtypes``). Checked
here: that carrier (round trips, shared memory, MindSpore's own numpy bfloat16 accepted),
the wire format (``ml_dtypes``' bfloat16 named, MindSpore's sent as it), whole runs of every
schedule family in process with swap on bit-identical to swap off and close to a float32
model on the same bfloat16 weights and batch, FSDP dp=2, float32 weights under
``torch.autocast`` to bfloat16, and the error where ``ml_dtypes`` is missing. Across
processes: ``tests/torch_dist`` (the ``-bf16`` cases).

The float32 reference: the gradients of a bfloat16 pipeline differ from it by rounding
(measured: at most 1.2% of a gradient's largest element on these models); a bfloat16
model is no reference, torch's CPU kernels reduce in bfloat16 and drift further from the
float32 values the larger the batch (tests/torch_dist/scripts/pipeline.py has figures).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn
from torch_support import (
    Case,
    build_modules,
    full_grads_by_stage,
    grads_of,
    make_data,
    predictions,
    run_case,
    unsplit_loss_and_grads,
)

import ppswap.backends.torch.host_arrays as host_arrays_module
from ppswap import PipelineStage, RunResult
from ppswap.backends.torch import BACKEND
from ppswap.core.dtypes import BFLOAT16, is_bfloat16, is_floating
from ppswap.core.wire import decode_header, encode_message, wire_array
from ppswap.errors import PipelineInputError
from ppswap.fsdp import DeviceMesh, fully_shard

assert BFLOAT16 is not None, "ml_dtypes comes with ppswap[torch]"

LOSS_RTOL = 1e-2
GRAD_TOLERANCE = 0.03  # of a gradient's largest magnitude (module docstring)

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=4, stage_num=4, micro=8, split_dw=True, p2p="boundary"),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, split_dw=True, overlap_b_f=True),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, p2p="batch"),
]


def bf16_stages(stage_num: int) -> list[PipelineStage]:
    return [
        PipelineStage(module.to(torch.bfloat16), index, stage_num)
        for index, module in enumerate(build_modules(stage_num))
    ]


def bf16_data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data(batch)
    return torch.from_numpy(x).bfloat16(), torch.from_numpy(y).bfloat16()


def float32_reference(
    stage_num: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, list[list[torch.Tensor]]]:
    """The unsplit model in float32 on the bfloat16-rounded weights and batch."""
    modules = [m.to(torch.bfloat16).float() for m in build_modules(stage_num, wrap=False)]
    return unsplit_loss_and_grads(modules, x.float().numpy(), y.float().numpy())


def assert_close_to(
    grads: Sequence[Sequence[torch.Tensor]], reference: Sequence[Sequence[torch.Tensor]]
) -> None:
    for index, (stage, stage_ref) in enumerate(zip(grads, reference, strict=True)):
        for k, (grad, ref) in enumerate(zip(stage, stage_ref, strict=True)):
            assert grad.dtype == torch.bfloat16 and grad.shape == ref.shape
            error = (grad.float() - ref).abs().max().item()
            bound = GRAD_TOLERANCE * ref.abs().max().item()
            assert error <= bound, f"stage {index} grad {k}: max |d| {error:.3g} > {bound:.3g}"


def assert_same_bits(
    expected: Sequence[Sequence[torch.Tensor]], actual: Sequence[Sequence[torch.Tensor]]
) -> None:
    for stage_e, stage_a in zip(expected, actual, strict=True):
        for e, a in zip(stage_e, stage_a, strict=True):
            assert e.dtype == a.dtype == torch.bfloat16
            assert torch.equal(e.view(torch.int16), a.view(torch.int16))


# -- the host carrier ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.linspace(-3, 3, 15).reshape(3, 5).bfloat16(),
        torch.linspace(-3, 3, 15).reshape(3, 5).bfloat16().t(),  # strided
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-d, as a loss
    ],
    ids=["contiguous", "transposed", "0-d"],
)
def test_a_bfloat16_tensor_and_its_host_array_share_memory_and_bits(tensor: torch.Tensor) -> None:
    host = BACKEND.to_host(tensor, copy=False)
    assert host.dtype == BFLOAT16 and host.shape == tuple(tensor.shape)
    assert host.ctypes.data == tensor.data_ptr()  # a view, not a copy
    np.testing.assert_array_equal(host.astype(np.float32), tensor.float().numpy())
    back = BACKEND.from_host(host)
    assert back.dtype == torch.bfloat16 and back.stride() == tensor.stride()
    assert back.data_ptr() == tensor.data_ptr()
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))
    copied = BACKEND.to_host(tensor, copy=True)
    assert copied.ctypes.data != tensor.data_ptr()
    assert BACKEND.numpy_dtype(tensor) == BFLOAT16


@pytest.mark.mindspore
def test_mindspores_numpy_bfloat16_is_read_as_torch_bfloat16_and_sent_as_ml_dtypes() -> None:
    """MindSpore registers a numpy bfloat16 of its own: the torch backend reads it by
    name and size; the wire sends it as ml_dtypes' (the same bytes), which the header
    names."""
    ms = pytest.importorskip("mindspore")
    values = ms.ops.arange(0, 6, dtype=ms.float32).reshape(2, 3) / 4 - 0.5
    theirs = values.astype(ms.bfloat16).asnumpy()
    assert theirs.dtype != BFLOAT16 and is_bfloat16(theirs.dtype) and is_floating(theirs.dtype)
    tensor = BACKEND.from_host(theirs)
    assert tensor.dtype == torch.bfloat16
    np.testing.assert_array_equal(tensor.float().numpy(), values.asnumpy())
    sent = wire_array(theirs, "payload")
    assert sent.dtype == BFLOAT16 and sent.tobytes() == theirs.tobytes()


def test_the_wire_names_bfloat16_and_decodes_it_bit_exact() -> None:
    array = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6).astype(BFLOAT16)
    message = encode_message(3, 7, wire_array(array, "payload"), inline_max_bytes=1024)
    nbytes, dtype, shape, size, _ = decode_header(message, 3, 7, ("test",))
    assert (nbytes, dtype, shape) == (array.nbytes, BFLOAT16, (4, 6))
    got = np.frombuffer(bytes(message[size : size + nbytes]), dtype=dtype).reshape(shape)
    assert got.tobytes() == array.tobytes()


# -- whole runs -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=Case.label)
async def test_a_bfloat16_model_swaps_bit_identically_and_matches_float32(case: Case) -> None:
    x, y = bf16_data(8)
    base_stages, swap_stages = bf16_stages(case.stage_num), bf16_stages(case.stage_num)
    base = await run_case(base_stages, case, swap=False, inputs=x, targets=y)
    swapped = await run_case(swap_stages, case, swap=True, inputs=x, targets=y)

    assert swapped.losses == base.losses
    assert_same_bits(grads_of(base_stages), grads_of(swap_stages))
    plan = predictions(case.config())
    for p, on in zip(plan, swapped.ranks, strict=True):
        assert (on.offloaded_bytes > 0) == bool(p.eligible), p
        assert on.loaded_bytes == on.offloaded_bytes
    assert any(p.eligible for p in plan), "the case must exercise swap"

    ref_loss, ref_grads = float32_reference(case.stage_num, x, y)
    assert base.loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    by_index = dict(zip((s.stage_index for s in base_stages), grads_of(base_stages), strict=True))
    assert_close_to([by_index[i] for i in range(case.stage_num)], ref_grads)


@pytest.mark.asyncio
async def test_fsdp_dp2_in_bfloat16_swaps_bit_identically_and_matches_float32() -> None:
    """GPipe pp=2 x dp=2: the shards, their gradients and the dp reduction in bfloat16
    (the reduction sums ml_dtypes arrays, rounding each sum to bfloat16 as torch does)."""
    case, dp = Case("gpipe", pp=2, stage_num=2, micro=4), 2
    mesh = DeviceMesh(pp=case.pp, dp=dp)
    x, y = bf16_data(dp * case.micro * 2)

    async def run(swap: bool) -> tuple[list[PipelineStage], RunResult]:
        stages = []
        for dp_rank in range(dp):
            for index, module in enumerate(build_modules(case.stage_num)):
                module = module.to(torch.bfloat16)
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
                stages.append(PipelineStage(module, index, case.stage_num))
        return stages, await run_case(stages, case, swap=swap, inputs=x, targets=y, mesh=mesh)

    base_stages, base = await run(False)
    swap_stages, swapped = await run(True)
    assert swapped.losses == base.losses
    assert sum(r.offloaded_bytes for r in swapped.ranks) > 0
    base_full = full_grads_by_stage(base_stages, case.stage_num)
    swap_full = full_grads_by_stage(swap_stages, case.stage_num)
    for stage_base, stage_swap in zip(base_full, swap_full, strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            assert g0.dtype == BFLOAT16 and g0.tobytes() == g1.tobytes()
    ref_loss, ref_grads = float32_reference(case.stage_num, x, y)
    assert base.loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert_close_to([[BACKEND.from_host(g) for g in s] for s in base_full], ref_grads)


class Autocast(nn.Module):
    """Mixed precision: float32 weights, the forward under ``torch.autocast`` in bfloat16
    entered by the stage's own forward (``test_torch_autocast.py`` has the caller's), a
    float32 output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = self.inner(x)
        return out.float()


@pytest.mark.asyncio
async def test_autocast_to_bfloat16_swaps_bit_identically() -> None:
    """The saved tensors are bfloat16 activations and the bfloat16 casts of the float32
    weights (autocast's own tensors, not parameters: they move too)."""
    case = CASES[3]  # Interleaved pp2, batched P2P
    x, y = make_data(8)
    runs = []
    for swap in (False, True):
        stages = [
            PipelineStage(Autocast(module), index, case.stage_num)
            for index, module in enumerate(build_modules(case.stage_num))
        ]
        runs.append((stages, await run_case(stages, case, swap=swap, inputs=x, targets=y)))
    (base_stages, base), (swap_stages, swapped) = runs
    assert swapped.losses == base.losses
    for stage_base, stage_swap in zip(grads_of(base_stages), grads_of(swap_stages), strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            assert g0.dtype == torch.float32 and torch.equal(g0, g1)
    assert sum(r.offloaded_bytes for r in swapped.ranks) > 0
    assert all(r.loaded_bytes == r.offloaded_bytes for r in swapped.ranks)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_without_ml_dtypes_a_bfloat16_batch_is_refused_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_arrays_module, "BFLOAT16", None)
    host_arrays_module.numpy_dtype_of.cache_clear()
    try:
        x, y = bf16_data(8)
        with pytest.raises(TypeError, match=r"torch\.bfloat16 .*ml_dtypes.*pip install ml_dtypes"):
            await run_case(bf16_stages(2), CASES[0], swap=False, inputs=x, targets=y)
    finally:
        host_arrays_module.numpy_dtype_of.cache_clear()


@pytest.mark.asyncio
async def test_a_bfloat16_batch_for_a_float32_model_is_refused_with_the_conversion() -> None:
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(build_modules(2))]
    x, y = bf16_data(8)
    with pytest.raises(PipelineInputError, match=r"inputs must have dtype float32.*bfloat16"):
        await run_case(stages, CASES[0], swap=False, inputs=x, targets=y)
