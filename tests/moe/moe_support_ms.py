"""MindSpore counterparts of ``moe_support``: a stage with a dense block and a MoE block,
the unsplit reference and the expected local gradients, by parameter position."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ppswap import PipelineStage, expert_parallel, fully_shard
from ppswap.backends.mindspore.moe import MoE
from ppswap.fsdp import DeviceMesh, fsdp_state_of
from ppswap.moe import expert_state_of
from ppswap.swap import swap_wrapper

DIM = 8
SEQ = 4
EXPERTS = 4


def make_data(batch: int, *, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The torch tests' data (``moe_support.make_data``), without importing torch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, SEQ, DIM)).astype(np.float32)
    y = rng.standard_normal((batch, SEQ, DIM)).astype(np.float32)
    return x, y


class DenseBlock(nn.Cell):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(DIM, 15)
        self.fc2 = nn.Dense(15, DIM)

    def construct(self, x: Tensor) -> Tensor:
        return x + self.fc2(ops.tanh(self.fc1(x)))


class MoEResidual(nn.Cell):  # type: ignore[misc]
    def __init__(self, top_k: int, aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.moe = MoE(DIM, 2 * DIM, EXPERTS, top_k=top_k, aux_loss_coef=aux_loss_coef)

    def construct(self, x: Tensor) -> Tensor:
        return x + self.moe(x)


class Stage(nn.Cell):  # type: ignore[misc]
    def __init__(self, top_k: int, aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.dense = swap_wrapper(DenseBlock())
        self.experts = swap_wrapper(MoEResidual(top_k, aux_loss_coef))

    def construct(self, x: Tensor) -> Tensor:
        return self.experts(self.dense(x))


def build_modules(
    stage_num: int, top_k: int, *, seed: int = 0, aux_loss_coef: float = 0.0
) -> list[Stage]:
    ms.set_seed(seed)
    return [Stage(top_k, aux_loss_coef) for _ in range(stage_num)]


def split_stage(
    module: Stage, index: int, stage_num: int, mesh: DeviceMesh, dp_rank: int
) -> PipelineStage:
    expert_parallel(module, mesh=mesh, dp_rank=dp_rank)
    fully_shard(module, mesh=mesh, dp_rank=dp_rank)
    return PipelineStage(module, index, stage_num)


def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def reference(
    stage_num: int, top_k: int, x: np.ndarray, y: np.ndarray
) -> tuple[float, list[list[np.ndarray]]]:
    """The unsplit model on the whole batch: the mean loss and each stage's gradients,
    aligned with its trainable parameters."""
    modules = build_modules(stage_num, top_k)
    params = [m.trainable_params() for m in modules]
    flat = [p for group in params for p in group]

    def loss_of(inputs: Tensor) -> Tensor:
        out = inputs
        for module in modules:
            out = module(out)
        return mse_loss(out, Tensor(y))

    loss, grads = ms.value_and_grad(loss_of, grad_position=None, weights=flat)(Tensor(x))
    by_stage, start = [], 0
    for group in params:
        by_stage.append([g.asnumpy() for g in grads[start : start + len(group)]])
        start += len(group)
    return float(loss.asnumpy()), by_stage


def expected_grads(stage: PipelineStage, ref: list[list[np.ndarray]]) -> list[np.ndarray]:
    """A stage's expected local gradients, aligned with its parameters."""
    fsdp = fsdp_state_of(stage.module)
    experts = expert_state_of(stage.module)
    assert fsdp is not None and experts is not None
    out = []
    for param, full in zip(stage.parameters, ref[stage.stage_index], strict=True):
        if fsdp.is_kept(param):
            count = full.shape[0] // experts.mesh.ep
            out.append(full[experts.ep_rank * count : (experts.ep_rank + 1) * count])
        else:
            out.append(fsdp.spec_of(param).split(full, fsdp.mesh.dp)[fsdp.dp_rank])
    return out


def chunked_reference(
    stage_num: int, top_k: int, x: np.ndarray, y: np.ndarray, chunks: int, aux_loss_coef: float
) -> tuple[float, list[list[np.ndarray]]]:
    """The unsplit model chunk by chunk (a run's (replica, micro) chunks in order), each
    chunk's loss its mean squared error plus every MoE block's load-balancing term, the
    whole loss their mean: the mean of the chunks' summed terms and each stage's
    gradients, aligned with its trainable parameters."""
    modules = build_modules(stage_num, top_k, aux_loss_coef=aux_loss_coef)
    blocks = [m.experts.module.moe for m in modules]
    params = [m.trainable_params() for m in modules]
    flat = [p for group in params for p in group]
    aux_values: list[float] = []

    def loss_of(xc: Tensor, yc: Tensor) -> Tensor:
        out = xc
        for module in modules:
            out = module(out)
        loss = mse_loss(out, yc)
        if aux_loss_coef:
            aux = blocks[0].aux_loss
            for block in blocks[1:]:
                aux = aux + block.aux_loss
            aux_values.append(float(aux.asnumpy()))
            loss = loss + aux
        return loss / chunks

    grad_fn = ms.value_and_grad(loss_of, grad_position=None, weights=flat)
    total: list[np.ndarray] | None = None
    for xc, yc in zip(np.split(x, chunks), np.split(y, chunks), strict=True):
        _, grads = grad_fn(Tensor(xc), Tensor(yc))
        arrays = [g.asnumpy() for g in grads]
        total = arrays if total is None else [a + b for a, b in zip(total, arrays, strict=True)]
    assert total is not None
    by_stage, start = [], 0
    for group in params:
        by_stage.append(total[start : start + len(group)])
        start += len(group)
    return sum(aux_values) / chunks, by_stage
