"""The MindSpore MoE block: unsplit, it computes the dense top-k mixture (numpy reference);
split over an EP group it runs with one process per rank (``mpiexec -n 4``, pp2 x dp2 x
ep2, 1F1B with overlap_b_f: every rank's loss and local gradients equal the unsplit
model's, swap on bit-identical to off); in one process it is refused in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore

ms = pytest.importorskip("mindspore")

from moe_support_ms import (  # noqa: E402
    DIM,
    build_modules,
    chunked_reference,
    expected_grads,
    make_data,
    mse_loss,
    reference,
    split_stage,
)

from ppswap import run_schedule  # noqa: E402
from ppswap.backends.mindspore.moe import MoE  # noqa: E402
from ppswap.fsdp import DeviceMesh  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
sys.path.insert(0, str(SCRIPTS))
from moe_run_ms import AUX_LOSS_COEF, MESH, MICRO, TOP_K  # noqa: E402
from test_mpi_transport import MPIEXEC, launch  # noqa: E402


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.exp(-a))


@pytest.mark.parametrize("top_k", [1, 2])
def test_unsplit_block_is_the_dense_top_k_mixture(top_k: int) -> None:
    ms.set_seed(0)
    block = MoE(DIM, 2 * DIM, 4, top_k=top_k)
    x = np.random.default_rng(0).standard_normal((3, 5, DIM)).astype(np.float32)
    out = block(ms.Tensor(x)).asnumpy().reshape(-1, DIM)
    tokens = x.reshape(-1, DIM)
    logits = tokens @ block.router.weight.asnumpy().T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    picked = np.argsort(-probs, -1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, picked, 1)
    weights /= weights.sum(-1, keepdims=True)
    w_in, w_out = block.w_in.asnumpy(), block.w_out.asnumpy()
    expected = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for slot in range(top_k):
            e = picked[t, slot]
            expected[t] += weights[t, slot] * (_silu(tokens[t] @ w_in[e]) @ w_out[e])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"top_k must be an int in 1..4, got 5"):
        MoE(DIM, 2 * DIM, 4, top_k=5)


@pytest.mark.asyncio
async def test_split_stages_in_one_process_are_refused() -> None:
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    stages = [
        split_stage(module, index, 2, mesh, dp_rank)
        for dp_rank in range(2)
        for index, module in enumerate(build_modules(2, 2))
    ]
    x, y = make_data(8)
    with pytest.raises(ValueError, match=r"stage 0: MindSpore stages run expert parallelism"):
        await run_schedule(
            stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss, pp=2
        )


@pytest.mark.mpi
def test_pp2_ep2_over_mpi_equals_the_unsplit_model(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    script = str(SCRIPTS / "moe_run_ms.py")
    result = launch(MESH.world_size, script, str(tmp_path), timeout_s=400)
    assert result.returncode == 0, result.output
    x, y = make_data(MESH.dp * MICRO * 2)
    ref_loss, ref_grads = reference(MESH.pp, TOP_K, x, y)
    for rank in range(MESH.world_size):
        coords = MESH.coords(rank)
        module = build_modules(MESH.pp, TOP_K)[coords.pp]
        layout = split_stage(module, coords.pp, MESH.pp, MESH, coords.dp)
        runs = [np.load(tmp_path / f"swap{swap}-rank{rank}.npz") for swap in (0, 1)]
        assert float(runs[0]["loss"]) == pytest.approx(ref_loss, rel=1e-5)
        np.testing.assert_array_equal(runs[1]["losses"], runs[0]["losses"])
        assert int(runs[1]["offloaded"]) > 0
        expected = expected_grads(layout, ref_grads)
        for k, want in enumerate(expected):
            off, on = runs[0][f"grad:{k}"], runs[1][f"grad:{k}"]
            np.testing.assert_array_equal(on, off)
            assert off.shape == want.shape
            np.testing.assert_allclose(off, want, rtol=1e-5, atol=1e-6, err_msg=f"{rank}:{k}")
    aux_ref, aux_grads = chunked_reference(MESH.pp, TOP_K, x, y, MESH.dp * MICRO, AUX_LOSS_COEF)
    for rank in range(MESH.world_size):
        coords = MESH.coords(rank)
        module = build_modules(MESH.pp, TOP_K, aux_loss_coef=AUX_LOSS_COEF)[coords.pp]
        layout = split_stage(module, coords.pp, MESH.pp, MESH, coords.dp)
        run = np.load(tmp_path / f"aux-rank{rank}.npz")
        assert run["aux_loss"].sum() / MESH.dp == pytest.approx(aux_ref, rel=1e-5)
        for k, want in enumerate(expected_grads(layout, aux_grads)):
            got = run[f"grad:{k}"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"aux {rank}:{k}")
