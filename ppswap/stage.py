"""PipelineStage: one (virtual) pipeline stage of a MindSpore model, run chunk by chunk.

A stage's forward and backward for a micro-batch are split in time: FWD records the
stage's forward (``ppswap.autograd.record_forward``, which, unlike ``mindspore.vjp``, lets
the backwards come in any order), BWD runs its backward later with the gradient arriving
from the next stage. All methods except the constructor and ``grads`` run on the runtime's
single compute thread (MindSpore autograd is not thread-safe).

dx/dw split: MindSpore's backward cannot compute the input gradient without the weight
gradient, so BWD_INPUT computes both, returns dx (to be sent upstream at once) and keeps dw;
BWD_WEIGHT later adds the kept dw into the accumulated gradients. The *schedule* is the
ZB-H1 one; the *compute* of dw is not deferred on this backend.

Gradients: ``stage.grads`` is aligned with ``module.trainable_params()`` and holds the
gradient of the mean loss over micro-batches (the last stage seeds each micro-batch's
backward with ``1 / micro_batch_num``), reset at the start of every training run. A
forward-only run (``begin_run(forward_only=True)``, ``forward(record=False)``: evaluation)
records no graph, keeps no chunk and leaves the gradients as the last training run left
them.

The loss: on the last stage ``loss_fn(output, target)`` must return a scalar Tensor. A
loss_fn that raises, returns something else or a tensor with a shape is reported as a
``PipelineInputError`` naming ``loss_fn`` (at the first FWD of the last stage, before
any backward runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from ppswap.autograd import record_forward, release_record, run_backward, run_without_graph
from ppswap.errors import PipelineInputError
from ppswap.swap import module_state_tensors

__all__ = ["LossFn", "PipelineStage", "StageCollector"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class StageCollector(Protocol):
    """What a stage needs from the swap session around one chunk's forward."""

    def collection_context(
        self,
        stage: int,
        micro: int,
        protected: Sequence[Tensor] = (),
        parameters: Sequence[Tensor] = (),
    ) -> Any: ...

    def protect_aliases(self, stage: int, micro: int, tensors: Sequence[Tensor]) -> None: ...


@dataclass(slots=True)
class _Chunk:
    # The record is keyed by the identity of these inputs: they live until the backward.
    inputs: tuple[Tensor, ...]
    output: Tensor | None  # kept only when the send hands it over without a copy
    # The output's shape and dtype: a zero sensitivity releases an abandoned record.
    output_shape: tuple[int, ...] = ()
    output_dtype: Any = None


class PipelineStage:
    """One stage ``stage_index`` of ``stage_num`` (global index; rank = index % pp)."""

    def __init__(self, module: nn.Cell | Callable[..., Any], stage_index: int, stage_num: int):
        if not isinstance(module, nn.Cell):
            raise TypeError(f"module must be a mindspore.nn.Cell, got {type(module).__name__}")
        for name, value in (("stage_index", stage_index), ("stage_num", stage_num)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if stage_num < 1:
            raise ValueError(f"stage_num must be >= 1, got {stage_num}")
        if not 0 <= stage_index < stage_num:
            raise ValueError(
                f"stage_index must be in 0..{stage_num - 1} (stage_num={stage_num}), "
                f"got {stage_index}"
            )
        self.module = module
        self.stage_index = stage_index
        self.stage_num = stage_num
        self.generation = 0
        self._params: tuple[ms.Parameter, ...] = tuple(module.trainable_params())
        self._grads: list[Tensor | None] = [None] * len(self._params)
        self._chunks: dict[int, _Chunk] = {}
        self._pending_dw: dict[int, tuple[Tensor, ...]] = {}
        self._loss_fn: LossFn | None = None
        self._micro_count = 1
        self._forward_fn: Callable[..., Tensor] | None = None
        self._module_state: tuple[Tensor, ...] = ()

    def __repr__(self) -> str:
        return f"PipelineStage({type(self.module).__name__}, {self.stage_index}/{self.stage_num})"

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_num - 1

    @property
    def parameters(self) -> tuple[ms.Parameter, ...]:
        return self._params

    @property
    def grads(self) -> tuple[Tensor, ...]:
        """Accumulated gradients of the last run, aligned with ``trainable_params()``."""
        return tuple(
            g if g is not None else ms.ops.zeros_like(p)
            for g, p in zip(self._grads, self._params, strict=True)
        )

    @property
    def live_chunks(self) -> int:
        return len(self._chunks) + len(self._pending_dw)

    # -- run lifecycle (compute thread) ---------------------------------------------------
    def begin_run(
        self,
        *,
        micro_count: int,
        loss_fn: LossFn | None,
        generation: int,
        forward_only: bool = False,
    ) -> None:
        if not forward_only:
            self._params = tuple(self.module.trainable_params())
            self._grads = [None] * len(self._params)
        # Parameters, buffers and plain tensor attributes (a shared mask, a rotary table):
        # module state that swap must never move.
        self._module_state = tuple(module_state_tensors(self.module))
        self._chunks.clear()
        self._pending_dw.clear()
        self._loss_fn = loss_fn
        self._micro_count = micro_count
        self.generation = generation
        self._forward_fn = self._make_forward_fn(loss_fn)

    def _make_forward_fn(self, loss_fn: LossFn | None) -> Callable[..., Tensor]:
        """The function whose forward is recorded: the module, plus the loss on the last
        stage (the target is an input of the record, so each micro-batch's is distinct)."""
        module = self.module
        if self.is_last:
            if loss_fn is None:
                raise ValueError(f"stage {self.stage_index} is the last stage: loss_fn is required")

            def stage_with_loss(x: Tensor, target: Tensor) -> Tensor:
                output = module(x)
                try:
                    loss = loss_fn(output, target)
                except Exception as exc:
                    raise PipelineInputError(
                        f"loss_fn {_name_of(loss_fn)} raised {type(exc).__name__} on an output "
                        f"of shape {_shape_of(output)} and a target of shape "
                        f"{_shape_of(target)}: {exc}"
                    ) from exc
                if not isinstance(loss, Tensor) or loss.shape != ():
                    raise PipelineInputError(
                        f"loss_fn {_name_of(loss_fn)} must return a scalar mindspore.Tensor "
                        f"(shape ()), got {type(loss).__name__} of shape {_shape_of(loss)}"
                    )
                return loss

            return stage_with_loss

        def stage_forward(x: Tensor) -> Tensor:
            out: Tensor = module(x)
            return out

        return stage_forward

    def abort_run(self, releasable: Callable[[int, int], bool] | None = None) -> None:
        """Drop every chunk of a failed or cancelled run (its graphs and saved tensors).

        A recorded forward whose backward never runs keeps what its saved-tensor hooks
        packed alive inside MindSpore for good, ``discard_all`` or not (measured on
        mindspore 2.10: every saved activation of the chunk; ppswap's swap collector is
        active around every FWD). So each chunk still recorded is released by running its
        backward with a zero sensitivity, in micro-batch order, results dropped (one
        backward's compute per abandoned chunk). ``releasable(stage, micro)`` (default:
        every chunk) says which chunks may run that backward: the runtime skips a chunk
        whose swap copy never finished (its unpack would wait for a copy that will never
        run). Best effort: a chunk skipped or whose backward fails is dropped as it is.
        """
        chunks = sorted(self._chunks.items())
        self._chunks.clear()
        self._pending_dw.clear()
        forward_fn = self._forward_fn
        if forward_fn is None:
            return
        for micro, chunk in chunks:
            if releasable is not None and not releasable(self.stage_index, micro):
                continue
            release_record(
                forward_fn, chunk.inputs, self._params, chunk.output_shape, chunk.output_dtype
            )

    # -- compute leaves (compute thread) --------------------------------------------------
    def forward(
        self,
        micro: int,
        inputs: Tensor,
        target: Tensor | None,
        collector: StageCollector,
        *,
        keep_output: bool = False,
        record: bool = True,
    ) -> Tensor:
        """FWD of one micro-batch. Returns the stage output, or the loss on the last stage.

        ``record=False`` (forward-only runs) runs the forward without recording a graph and
        without the swap collector: nothing is kept for a backward.
        """
        if micro in self._chunks or micro in self._pending_dw:
            raise RuntimeError(f"stage {self.stage_index}: FWD of micro {micro} ran twice")
        if self._forward_fn is None:
            raise RuntimeError(f"stage {self.stage_index}: begin_run() was not called")
        inputs_for_graph = (inputs,) if target is None else (inputs, target)
        if not record:
            return run_without_graph(self._forward_fn, inputs_for_graph)
        with collector.collection_context(
            self.stage_index, micro, protected=inputs_for_graph, parameters=self._module_state
        ):
            out = record_forward(self._forward_fn, inputs_for_graph)
        collector.protect_aliases(self.stage_index, micro, [out])
        self._chunks[micro] = _Chunk(
            inputs_for_graph, out if keep_output else None, tuple(out.shape), out.dtype
        )
        return out

    def backward(self, micro: int, grad_output: Tensor | None, *, split: bool) -> Tensor | None:
        """BWD (``split=False``) or BWD_INPUT (``split=True``) of one micro-batch.

        Returns the gradient for the previous stage's output (None on the first stage).
        """
        chunk = self._chunks.pop(micro, None)
        if chunk is None:
            raise RuntimeError(f"stage {self.stage_index}: BWD of micro {micro} before its FWD")
        if self.is_last:
            sens = Tensor(np.float32(1.0 / self._micro_count))
        elif grad_output is None:
            raise RuntimeError(f"stage {self.stage_index}: BWD of micro {micro} has no gradient")
        else:
            sens = grad_output
        assert self._forward_fn is not None
        input_grads, weight_grads = run_backward(self._forward_fn, chunk.inputs, self._params, sens)
        del chunk
        if split:
            self._pending_dw[micro] = tuple(weight_grads)
        else:
            self._accumulate(weight_grads)
        if self.is_first:
            return None
        return input_grads[0]

    def backward_weight(self, micro: int) -> None:
        """BWD_WEIGHT: add the dw that BWD_INPUT kept."""
        weight_grads = self._pending_dw.pop(micro, None)
        if weight_grads is None:
            raise RuntimeError(
                f"stage {self.stage_index}: BWD_WEIGHT of micro {micro} before its BWD_INPUT"
            )
        self._accumulate(weight_grads)

    def replace_grads(self, grads: Sequence[Tensor]) -> None:
        """Replace the accumulated gradients, aligned with ``parameters`` (FSDP installs the
        reduce-scattered shard gradients here after the stage's last backward)."""
        if len(grads) != len(self._params):
            raise ValueError(
                f"stage {self.stage_index}: grads must hold {len(self._params)} tensors "
                f"(one per trainable parameter), got {len(grads)}"
            )
        self._grads = list(grads)

    def _accumulate(self, weight_grads: Sequence[Tensor]) -> None:
        if len(weight_grads) != len(self._grads):
            raise RuntimeError(
                f"stage {self.stage_index}: got {len(weight_grads)} weight gradients for "
                f"{len(self._grads)} parameters"
            )
        for index, grad in enumerate(weight_grads):
            current = self._grads[index]
            self._grads[index] = grad if current is None else current + grad


def _name_of(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _shape_of(value: object) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)
