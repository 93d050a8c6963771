"""Helpers for the MoE pipeline tests: a torch stage with a dense block and a MoE block,
its EP x FSDP replicas, the unsplit reference and the per-rank gradient check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ppswap import PipelineStage, recompute_wrapper
from ppswap.backends.torch.moe import MoE
from ppswap.fsdp import DeviceMesh, fsdp_state_of, fully_shard
from ppswap.moe import expert_parallel, expert_state_of
from ppswap.swap import swap_wrapper

DIM = 8
SEQ = 4
EXPERTS = 4
RTOL = 1e-5
ATOL = 1e-6


class MoEResidual(nn.Module):
    """``x + moe(x)``."""

    def __init__(self, top_k: int, aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.moe = MoE(DIM, 2 * DIM, EXPERTS, top_k=top_k, aux_loss_coef=aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(x)
        return out


class DenseBlock(nn.Module):
    """``x + fc2(tanh(fc1(x)))`` (fc1's 15 rows pad FSDP's dp=2 shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 15)
        self.fc2 = nn.Linear(15, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(x)))
        return out


def build_modules(
    stage_num: int,
    top_k: int,
    *,
    seed: int = 0,
    aux_loss_coef: float = 0.0,
    wrap: Callable[[nn.Module], nn.Module] = swap_wrapper,
) -> list[nn.Module]:
    """Stage modules (a dense block, then a MoE block, each ``wrap``-ped) from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [
            nn.Sequential(wrap(DenseBlock()), wrap(MoEResidual(top_k, aux_loss_coef)))
            for _ in range(stage_num)
        ]


def ep_stages(
    stage_num: int,
    mesh: DeviceMesh,
    top_k: int,
    *,
    shard_first: bool = False,
    aux_loss_coef: float = 0.0,
    wrap: Callable[[nn.Module], nn.Module] = swap_wrapper,
) -> list[PipelineStage]:
    """Every (stage, dp replica): the experts split by ``expert_parallel``, the dense
    parameters by ``fully_shard`` (in either order)."""
    stages: list[PipelineStage] = []
    for dp_rank in range(mesh.dp):
        modules = build_modules(stage_num, top_k, aux_loss_coef=aux_loss_coef, wrap=wrap)
        for index, module in enumerate(modules):
            if shard_first:
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
                expert_parallel(module, mesh=mesh, dp_rank=dp_rank)
            else:
                expert_parallel(module, mesh=mesh, dp_rank=dp_rank)
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


def make_data(batch: int, *, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, SEQ, DIM)).astype(np.float32)
    y = rng.standard_normal((batch, SEQ, DIM)).astype(np.float32)
    return x, y


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def recompute_and_swap(module: nn.Module) -> nn.Module:
    """``module`` wrapped by ``recompute_wrapper`` and ``swap_wrapper`` (the plan picks)."""
    wrapped: nn.Module = recompute_wrapper(swap_wrapper(module))
    return wrapped


def reference(
    stage_num: int,
    top_k: int,
    x: np.ndarray,
    y: np.ndarray,
    *,
    wrap: Callable[[nn.Module], nn.Module] = swap_wrapper,
) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """The unsplit model (every expert local, the same routing) on the whole batch: the
    mean loss and each stage's gradients by parameter name."""
    modules = build_modules(stage_num, top_k, wrap=wrap)
    out = torch.from_numpy(x)
    for module in modules:
        out = module(out)
    loss = mse_loss(out, torch.from_numpy(y))
    loss.backward()
    return float(loss.detach()), [
        {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        for m in modules
    ]


def local_grads(stage: PipelineStage) -> dict[str, np.ndarray]:
    """A stage's gradients after a run, by parameter name, as host copies."""
    names = {id(p): name for name, p in stage.module.named_parameters()}
    return {
        names[id(p)]: g.detach().clone().numpy()
        for p, g in zip(stage.parameters, stage.grads, strict=True)
    }


def expected_grads(
    stage: PipelineStage, ref_grads: list[dict[str, torch.Tensor]]
) -> dict[str, np.ndarray]:
    """What a stage's local gradients must be, by name, from the reference's: a dense
    shard's rows of the full gradient, an expert's own slice of the stacked one."""
    fsdp = fsdp_state_of(stage.module)
    experts = expert_state_of(stage.module)
    assert fsdp is not None and experts is not None
    expected: dict[str, np.ndarray] = {}
    for name, param in stage.module.named_parameters():
        full = ref_grads[stage.stage_index][name].numpy()
        if fsdp.is_kept(param):
            count = full.shape[0] // experts.mesh.ep
            expected[name] = full[experts.ep_rank * count : (experts.ep_rank + 1) * count]
        else:
            expected[name] = fsdp.spec_of(param).split(full, fsdp.mesh.dp)[fsdp.dp_rank]
    return expected


def check_grads(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> int:
    """``got`` equals ``expected`` (rtol 1e-5), name by name; how many were compared."""
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert grad.shape == expected[name].shape, name
        np.testing.assert_allclose(grad, expected[name], rtol=RTOL, atol=ATOL, err_msg=name)
    return len(got)


def check_against_reference(
    stages: Sequence[PipelineStage], ref_grads: list[dict[str, torch.Tensor]]
) -> int:
    """Every rank's local gradients equal the reference's (``expected_grads``). Returns
    how many were compared."""
    return sum(check_grads(local_grads(s), expected_grads(s, ref_grads)) for s in stages)


def check_process_run(
    out_dir: Path, mesh: DeviceMesh, micro: int, top_k: int, *, stage_num: int
) -> None:
    """What ``scripts/moe_run.py`` wrote, rank by rank: the loss and local gradients equal
    the unsplit model's (rtol 1e-5), swap on and recompute equal swap off bit for bit,
    and swap moved chunks."""
    x, y = make_data(mesh.dp * micro * 2)
    ref_loss, ref_grads = reference(stage_num, top_k, x, y, wrap=recompute_and_swap)
    # the same splits, for the expected slices
    layout = ep_stages(stage_num, mesh, top_k, wrap=recompute_and_swap)
    compared = 0
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        (stage,) = [s for s in layout if s.stage_index == coords.pp][coords.dp : coords.dp + 1]
        runs = [np.load(out_dir / f"{n}-rank{rank}.npz") for n in ("swap0", "swap1", "recompute")]
        off, on, recomputed = (
            {k.removeprefix("grad:"): run[k] for k in run.files if k.startswith("grad:")}
            for run in runs
        )
        assert float(runs[0]["loss"]) == pytest.approx(ref_loss, rel=1e-5)
        np.testing.assert_array_equal(runs[1]["losses"], runs[0]["losses"])
        np.testing.assert_array_equal(runs[2]["losses"], runs[0]["losses"])
        assert int(runs[1]["offloaded"]) > 0  # swap moved chunks
        for name, grad in off.items():
            np.testing.assert_array_equal(on[name], grad, err_msg=name)
            np.testing.assert_array_equal(recomputed[name], grad, err_msg=name)
        compared += check_grads(off, expected_grads(stage, ref_grads))
    assert compared == mesh.world_size * 7


def chunked_reference(
    stage_num: int,
    top_k: int,
    x: np.ndarray,
    y: np.ndarray,
    chunks: int,
    aux_loss_coef: float,
    *,
    wrap: Callable[[nn.Module], nn.Module] = swap_wrapper,
) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """The unsplit model chunk by chunk (``chunks`` equal contiguous parts of the batch:
    a run's (replica, micro) chunks in order), each chunk's loss its mean squared error
    plus every MoE block's load-balancing term on the chunk's tokens, the whole loss their
    mean. Returns the mean of the chunks' summed terms and each stage's gradients."""
    modules = build_modules(stage_num, top_k, aux_loss_coef=aux_loss_coef, wrap=wrap)
    blocks = [sub for module in modules for sub in module.modules() if isinstance(sub, MoE)]
    aux_total = 0.0
    for xc, yc in zip(np.split(x, chunks), np.split(y, chunks), strict=True):
        out = torch.from_numpy(xc)
        for module in modules:
            out = module(out)
        loss = mse_loss(out, torch.from_numpy(yc))
        if aux_loss_coef:
            aux = sum(block.aux_loss for block in blocks if block.aux_loss is not None)
            assert isinstance(aux, torch.Tensor)
            aux_total += float(aux.detach()) / chunks
            loss = loss + aux
        (loss / chunks).backward()
    return aux_total, [
        {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        for m in modules
    ]
