"""PipelineStage: one (virtual) pipeline stage of a model, run chunk by chunk.

The stage's module belongs to a tensor framework (a ``mindspore.nn.Cell``, a
``torch.nn.Module``); the stage reaches it only through its backend
(``ppswap.backends``), chosen from the module's type at construction.

The stage holds what the user gave (the module, its index among ``stage_num``, tied
parameters) and what a user reads after a run (``grads``, ``generation``). What a run
does with it, and everything the run changes on the way, lives in a ``StageRun``
(``ppswap.stage_run``) the runtime makes per stage and run and drops at the run's end: a
successful run sets the stage's results, a failed or cancelled one leaves the stage as
it was.

A stage's forward and backward for a micro-batch are split in time: FWD records the
stage's forward (``backend.autograd.record``: backwards may come in any order), BWD runs
its backward later with the gradient arriving from the next stage.

dx/dw split: BWD_INPUT returns dx (to be sent upstream at once) and keeps what BWD_WEIGHT
needs; BWD_WEIGHT later adds dw into the accumulated gradients. Whether the dw compute is
really deferred is the backend's (torch: yes; MindSpore: its backward computes both).

Gradients: ``stage.grads`` is aligned with ``stage.parameters`` (the module's trainable
parameters: ``trainable_params()`` / ``parameters()`` with ``requires_grad``) and holds
the gradient of the mean loss over micro-batches of the last successful training run (the
last stage seeds each micro-batch's backward with ``1 / micro_batch_num``, times the run's
``loss_scale``): each training run's gradients start from none, and are set on the stage
when it ends successfully. A forward-only run (evaluation) records no graph, keeps no
chunk and leaves the gradients as the last training run left them.

Random numbers (dropout): each forward draws from the stage's own stream for the run
(``Backend.rng_scope``; torch: ``backends/torch/rng.py``), so a stage's draws do not depend
on what other stages ran on the compute thread before it: the same with swap on and off,
in one process or one per rank.

Each forward, with its loss, runs in the scope the run read from the thread that called
``run_schedule`` (``Backend.caller_forward_scope``): on torch, that thread's
``torch.autocast`` and current CUDA device, which the compute thread would not otherwise
see. Backwards run outside it.

The loss: on the last stage ``loss_fn(output, target)`` must return a scalar tensor
(``target``: the micro-batch's target, or a tuple of its parts where ``targets`` is a
tuple, such as ``(labels, loss_mask)``). A loss_fn that raises, returns something else
or a tensor with a shape is reported as a ``PipelineInputError`` naming ``loss_fn`` (at
the first FWD of the last stage, before any backward runs).

Between stages: a stage's module (but the last's) returns one tensor or a tuple (or list)
of up to 64 tensors, and the next stage's module is called with them as positional
arguments. Its backward returns one gradient per input, None for an input that gets none
(an integer mask). Anything else returned (a dict, a tuple holding a non-tensor) is a
``PipelineInputError`` naming the stage and the element, at its first FWD.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ppswap.backends import backend_for, type_name
from ppswap.backends.base import Backend, CopyEngine
from ppswap.backends.types import Module, Tensor

__all__ = ["LossFn", "PipelineStage"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class PipelineStage:
    """One stage ``stage_index`` of ``stage_num`` (global index; rank = index % pp)."""

    def __init__(
        self,
        module: Module,
        stage_index: int,
        stage_num: int,
        *,
        tied: Mapping[str, str] | None = None,
    ):
        """``tied``: parameters this stage shares with other stages, by attribute path,
        each under a key that every stage holding a copy declares (``{"wte.weight":
        "embedding"}``; ``ppswap/planning/ties.py``): after a training run each copy's
        gradient is the sum over the copies. In one process a parameter object that
        several stages hold is tied without it."""
        backend = backend_for(module)
        if not backend.is_module(module):
            raise TypeError(
                f"module must be a mindspore.nn.Cell or a torch.nn.Module, got {type_name(module)}"
            )
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
        self.backend: Backend = backend
        self.stage_index = stage_index
        self.stage_num = stage_num
        self.tied: Mapping[str, str] = tied if tied is not None else {}
        self.generation = 0  # of the last successful run, 0 before any
        self._params: tuple[Tensor, ...] = backend.trainable_parameters(module)
        self._grads: tuple[Tensor | None, ...] = (None,) * len(self._params)
        self._copy_engine: tuple[str, CopyEngine] | None = None

    def __repr__(self) -> str:
        return f"PipelineStage({type(self.module).__name__}, {self.stage_index}/{self.stage_num})"

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_num - 1

    @property
    def parameters(self) -> tuple[Tensor, ...]:
        return self._params

    @property
    def device_tensor(self) -> Tensor | None:
        """A tensor on the stage's device (its first parameter), for placing inputs."""
        return self._params[0] if self._params else None

    @property
    def grads(self) -> tuple[Tensor, ...]:
        """The gradients of the last successful training run, aligned with ``parameters``
        (zeros where a parameter got none, and before any run)."""
        return tuple(
            g if g is not None else self.backend.zeros_like(p)
            for g, p in zip(self._grads, self._params, strict=True)
        )

    def default_copy_engine(self) -> CopyEngine:
        """The copy engine a run led by this stage uses when it is given none: its
        backend's engine for the module's device, made on first use and kept (made again
        if the module moved to another device). Host buffers and device blocks pooled in
        one step then serve the next, as a device's caching allocator keeps its memory;
        ``default_copy_engine().clear_pool()`` gives the idle ones back."""
        device = self.backend.device_of(self.module)
        kept = self._copy_engine
        if kept is None or kept[0] != device:
            kept = self._copy_engine = (device, self.backend.copy_engine(device))
        return kept[1]

    def set_run_results(
        self, generation: int, grads: Sequence[tuple[Tensor, Tensor | None]] | None
    ) -> None:
        """The end of a successful run (``StageRun.publish``): its ``generation``, and for
        a training run each trainable parameter with its gradient (None where it got
        none), what ``parameters`` and ``grads`` read from now on."""
        self.generation = generation
        if grads is not None:
            self._params = tuple(param for param, _ in grads)
            self._grads = tuple(grad for _, grad in grads)
