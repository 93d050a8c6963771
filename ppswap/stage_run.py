"""StageRun: what one run does with one ``PipelineStage``, and everything it changes.

The runtime makes one StageRun per stage and run, on the compute thread, as the run
begins, and drops it when the run ends. It holds all the run's mutable state of the
stage: the parameters the run trains and their gradients accumulated so far, the records
of forwards waiting for their backward, the dw halves waiting for their BWD_WEIGHT, the
stage's random-number stream for the run, the function whose forward is recorded (the
module, plus the loss on the last stage) and the caller's scope the forwards run in.
The ``PipelineStage`` itself changes only at the end of a successful run
(``publish``: its gradients and generation); a failed or cancelled run drops its
StageRun (``abort`` releases its records first) and leaves the stage as it was. Two runs
never share mutable state through a stage.

All methods run on the runtime's compute thread. The contract each leaf keeps (the loss,
what travels between stages, random numbers, the caller's scope) is the stage's
(``ppswap.stage``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from ppswap.backends.autograd import ForwardRecord, WeightGrads
from ppswap.backends.base import Backend, ForwardScope, RngStream
from ppswap.backends.types import Module, Tensor
from ppswap.core.packed import MAX_ELEMENTS
from ppswap.errors import PipelineInputError
from ppswap.stage import LossFn, PipelineStage

__all__ = ["StageCollector", "StageRun", "StageRuns"]


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
    record: ForwardRecord
    # Kept only when the send hands it over without a copy, or the loss (last stage).
    output: Tensor | None
    # The stage's inputs (the target not counted); a tuple of them, or one tensor.
    input_count: int
    tupled: bool


class StageRun:
    """Stage ``stage`` during one run (module docstring)."""

    def __init__(
        self,
        stage: PipelineStage,
        *,
        micro_count: int,
        loss_fn: LossFn | None,
        forward_only: bool = False,
        rng_seed: int = 0,
        forward_scope: ForwardScope = nullcontext,
        input_keys: tuple[str, ...] | None = None,
        target_parts: int | None = None,
        loss_scale: float = 1.0,
    ) -> None:
        """Ready ``stage`` for a run (compute thread): a training run's gradients start
        from none, over the module's trainable parameters as they are now; the forward
        made; the stage's random-number stream for the run seeded from ``rng_seed``
        (``Backend.run_seed``, the same for every stage of the run); ``forward_scope``
        (``Backend.caller_forward_scope``) entered around each forward with its loss.
        ``input_keys``: the first stage's module is called with its inputs as these
        keyword arguments (a batch given as a dict). ``target_parts``: the last stage's
        target is a tuple of that many tensors (``loss_fn`` gets the tuple), None: one
        tensor. ``loss_scale``: the last stage seeds each backward with ``loss_scale /
        micro_count``. A forward-only run leaves the stage's gradients as they are."""
        backend = stage.backend
        self.stage = stage
        self.backend: Backend = backend
        self.module: Module = stage.module
        self.stage_index = stage.stage_index
        self.is_first = stage.is_first
        self.is_last = stage.is_last
        self.forward_only = forward_only
        self._params: tuple[Tensor, ...] = (
            stage.parameters if forward_only else backend.trainable_parameters(stage.module)
        )
        self._grads: list[Tensor | None] = [None] * len(self._params)
        self._summed = [False] * len(self._params)  # the gradient is a sum this run made
        self._chunks: dict[int, _Chunk] = {}
        self._pending_dw: dict[int, WeightGrads] = {}
        self._seed = loss_scale / micro_count  # each backward's seed on the last stage
        # Parameters, buffers and plain tensor attributes (a shared mask, a rotary table):
        # module state that swap must never move.
        self._module_state = tuple(backend.module_state(stage.module))
        self._device = backend.device_of(stage.module)
        self._rng = RngStream(stage.stage_index, rng_seed)
        self._forward_scope = forward_scope
        keys = input_keys if stage.is_first else None
        self._forward_fn = self._make_forward_fn(loss_fn, forward_only, keys, target_parts)

    def __repr__(self) -> str:
        return f"StageRun({self.stage!r})"

    @property
    def parameters(self) -> tuple[Tensor, ...]:
        """The parameters this run trains (the stage's as the run began)."""
        return self._params

    @property
    def device_tensor(self) -> Tensor | None:
        """A tensor on the stage's device (its first parameter), for placing inputs."""
        return self._params[0] if self._params else None

    @property
    def grads(self) -> tuple[Tensor, ...]:
        """The gradients accumulated so far, aligned with ``parameters`` (zeros where a
        parameter got none)."""
        return tuple(
            g if g is not None else self.backend.zeros_like(p)
            for g, p in zip(self._grads, self._params, strict=True)
        )

    @property
    def live_chunks(self) -> int:
        """Forwards recorded whose backward (or BWD_WEIGHT) has not run."""
        return len(self._chunks) + len(self._pending_dw)

    def forward_scope(self) -> AbstractContextManager[None]:
        """The caller's per-thread settings this run's forwards see, for a step that runs
        the module again (RECOMPUTE)."""
        return self._forward_scope()

    # -- the run's end ----------------------------------------------------------------------
    def publish(self, generation: int) -> None:
        """After a successful run: the stage's results (``PipelineStage.grads`` of a
        training run, aligned with ``parameters``; ``generation``)."""
        results = None if self.forward_only else self.run_grads()
        self.stage.set_run_results(generation, results)

    def abort(self, releasable: Callable[[int, int], bool] | None = None) -> None:
        """Drop every chunk of a failed or cancelled run (its graphs and saved tensors).

        A recorded forward whose backward never runs may keep what its saved-tensor hooks
        packed alive inside the framework for good (measured on mindspore 2.10: every
        saved activation of the chunk). So each chunk still recorded is released through
        the backend (``autograd.release``: MindSpore runs its backward with a zero
        sensitivity), in micro-batch order. ``releasable(stage, micro)`` (default: every
        chunk) says which chunks may be released that way: the runtime skips a chunk whose
        swap copy never finished (its unpack would wait for a copy that will never run).
        Best effort: a chunk skipped or whose release fails is dropped as it is.
        """
        chunks = sorted(self._chunks.items())
        self._chunks.clear()
        self._pending_dw.clear()
        for micro, chunk in chunks:
            if releasable is not None and not releasable(self.stage_index, micro):
                continue
            self.backend.autograd.release(chunk.record, self._params)

    # -- the recorded function ------------------------------------------------------------
    def _make_forward_fn(
        self,
        loss_fn: LossFn | None,
        forward_only: bool,
        input_keys: tuple[str, ...] | None,
        target_parts: int | None,
    ) -> Callable[..., Tensor]:
        """The function whose forward is recorded: the module, plus the loss on the last
        stage (the target, or its ``target_parts`` parts, are the last inputs of the
        record, so each micro-batch's is distinct); the module alone on a last stage
        without ``loss_fn`` in a forward-only run (its outputs are the result)."""
        backend = self.backend  # not a method of self: the run keeps this closure
        tensor_name = self.backend.tensor_name
        call = self._module_caller(input_keys)
        if self.is_last and not (forward_only and loss_fn is None):
            if loss_fn is None:
                raise ValueError(
                    f"stage {self.stage_index} is the last stage: loss_fn is required (but in "
                    "a forward-only run)"
                )

            split = -1 if target_parts is None else -target_parts

            def stage_with_loss(*inputs_and_target: Tensor) -> Tensor:
                inputs, parts = inputs_and_target[:split], inputs_and_target[split:]
                target = parts[0] if target_parts is None else parts
                output = call(inputs)
                try:
                    loss = loss_fn(output, target)
                except Exception as exc:
                    shapes = ", ".join(str(_shape_of(part)) for part in parts)
                    target_of = "a target of shape" if target_parts is None else "targets of shapes"
                    raise PipelineInputError(
                        f"loss_fn {_name_of(loss_fn)} raised {type(exc).__name__} on an output "
                        f"of shape {_shape_of(output)} and {target_of} {shapes}: {exc}"
                    ) from exc
                if not (backend.is_tensor(loss) and backend.shape_of(loss) == ()):
                    raise PipelineInputError(
                        f"loss_fn {_name_of(loss_fn)} must return a scalar {tensor_name} "
                        f"(shape ()), got {_described(loss)}"
                    )
                return loss

            return stage_with_loss

        is_tensor, index = self.backend.is_tensor, self.stage_index

        def stage_forward(*inputs: Tensor) -> Any:
            out = call(inputs)
            if is_tensor(out):
                return out
            if isinstance(out, tuple | list) and 0 < len(out) <= MAX_ELEMENTS:
                strays = [i for i, element in enumerate(out) if not is_tensor(element)]
                if not strays:
                    return tuple(out)
                raise PipelineInputError(
                    f"stage {index}'s module returned a {type(out).__name__} whose element "
                    f"{strays[0]} is {_described(out[strays[0]])}: every element travels to "
                    f"the next stage, so each must be a {tensor_name}"
                )
            raise PipelineInputError(
                f"stage {index}'s module must return a {tensor_name} or a tuple of 1 to "
                f"{MAX_ELEMENTS} of them (what the next stage's module is called with), got "
                f"{_described(out)}"
            )

        return stage_forward

    def _module_caller(self, keys: tuple[str, ...] | None) -> Callable[[Sequence[Tensor]], Any]:
        """``call(inputs)``: the module on its inputs, as the keyword arguments ``keys``
        where given; a TypeError where it got several (a tuple the previous stage
        returned, the batch's parts) is a PipelineInputError saying so."""
        module, index = self.module, self.stage_index
        source = "parts of the batch" if self.is_first else f"tensors stage {index - 1} returned"
        if keys is not None:
            source = f"keyword arguments {', '.join(keys)} (the batch's parts)"

        def call(inputs: Sequence[Tensor]) -> Any:
            if len(inputs) == 1 and keys is None:
                return module(inputs[0])
            try:
                if keys is not None:
                    return module(**dict(zip(keys, inputs, strict=True)))
                return module(*inputs)
            except TypeError as exc:
                shapes = ", ".join(str(_shape_of(x)) for x in inputs)
                raise PipelineInputError(
                    f"stage {index}'s module raised TypeError when called with the "
                    f"{len(inputs)} {source} (shapes {shapes}): {exc}"
                ) from exc

        return call

    # -- compute leaves -----------------------------------------------------------------
    def forward(
        self,
        micro: int,
        inputs: Tensor | tuple[Tensor, ...],
        target: Tensor | tuple[Tensor, ...] | None,
        collector: StageCollector,
        *,
        keep_output: bool = False,
        record: bool = True,
    ) -> Tensor | tuple[Tensor, ...]:
        """FWD of one micro-batch (``inputs``: a tensor, or a tuple the module is called
        with). Returns the stage output (a tensor or a tuple), or the loss on the last stage.

        ``record=False`` (forward-only runs) runs the forward without recording a graph and
        without the swap collector: nothing is kept for a backward.
        """
        if micro in self._chunks or micro in self._pending_dw:
            raise RuntimeError(f"stage {self.stage_index}: FWD of micro {micro} ran twice")
        tupled = isinstance(inputs, tuple)
        stage_inputs = inputs if tupled else (inputs,)
        targets = () if target is None else target if isinstance(target, tuple) else (target,)
        inputs_for_graph = (*stage_inputs, *targets)
        autograd = self.backend.autograd
        rng = self.backend.rng_scope(self._rng, self._device)
        if not record:
            with rng, self._forward_scope():
                return autograd.run_without_graph(self._forward_fn, inputs_for_graph)
        with (
            rng,
            self._forward_scope(),
            collector.collection_context(
                self.stage_index, micro, protected=inputs_for_graph, parameters=self._module_state
            ),
        ):
            # dx only for a previous stage: the first stage's inputs and the target need none
            grad_inputs = (not self.is_first,) * len(stage_inputs) + (False,) * len(targets)
            out, recorded = autograd.record(self._forward_fn, inputs_for_graph, grad_inputs)
        collector.protect_aliases(self.stage_index, micro, out if isinstance(out, tuple) else [out])
        kept = out if keep_output or self.is_last else None
        self._chunks[micro] = _Chunk(recorded, kept, len(stage_inputs), tupled)
        return out

    def backward(
        self,
        micro: int,
        grad_output: Tensor | tuple[Tensor | None, ...] | None,
        *,
        split: bool,
    ) -> Tensor | tuple[Tensor | None, ...] | None:
        """BWD (``split=False``) or BWD_INPUT (``split=True``) of one micro-batch.

        ``grad_output``: the gradient of the output (a tuple of them, None where an output
        got none, for a tuple output). Returns the gradient for the previous stage's output
        (a tuple for a tuple input; None on the first stage).
        """
        chunk = self._chunks.pop(micro, None)
        if chunk is None:
            raise RuntimeError(f"stage {self.stage_index}: BWD of micro {micro} before its FWD")
        if self.is_last:
            assert chunk.output is not None
            sens = self.backend.scalar_like(self._seed, like=chunk.output)
        elif grad_output is None:
            raise RuntimeError(f"stage {self.stage_index}: BWD of micro {micro} has no gradient")
        else:
            sens = grad_output
        autograd = self.backend.autograd
        if split:
            input_grads, pending = autograd.backward_input(chunk.record, sens, self._params)
            self._pending_dw[micro] = pending
        else:
            input_grads, weight_grads = autograd.backward(chunk.record, sens, self._params)
            self._accumulate(weight_grads)
        if self.is_first:
            return None
        if chunk.tupled:
            return tuple(input_grads[: chunk.input_count])
        return input_grads[0]

    def backward_weight(self, micro: int) -> None:
        """BWD_WEIGHT: add the dw of the BWD_INPUT of the same micro-batch."""
        pending = self._pending_dw.pop(micro, None)
        if pending is None:
            raise RuntimeError(
                f"stage {self.stage_index}: BWD_WEIGHT of micro {micro} before its BWD_INPUT"
            )
        self._accumulate(pending())

    def run_grads(self) -> list[tuple[Tensor, Tensor | None]]:
        """After a training run: each trainable parameter with the run's gradient (None
        where it got none), what ``Backend.give_grads`` hands to the framework."""
        return list(zip(self._params, self._grads, strict=True))

    def replace_grads(self, grads: Sequence[Tensor]) -> None:
        """Replace the accumulated gradients, aligned with ``parameters`` (FSDP installs the
        reduce-scattered shard gradients here after the stage's last backward)."""
        if len(grads) != len(self._params):
            raise ValueError(
                f"stage {self.stage_index}: grads must hold {len(self._params)} tensors "
                f"(one per trainable parameter), got {len(grads)}"
            )
        self._grads = list(grads)
        self._summed = [False] * len(self._params)

    def _accumulate(self, weight_grads: Sequence[Tensor]) -> None:
        if len(weight_grads) != len(self._grads):
            raise RuntimeError(
                f"stage {self.stage_index}: got {len(weight_grads)} weight gradients for "
                f"{len(self._grads)} parameters"
            )
        # The first micro-batch's gradient is kept as it is (autograd's own tensor), the
        # second makes a sum this stage owns, and later ones are added into that sum (in
        # place where the backend can: one allocation per parameter and run, not per micro).
        add_into, summed = self.backend.add_into, self._summed
        for index, grad in enumerate(weight_grads):
            current = self._grads[index]
            if current is None:
                self._grads[index] = grad
            elif summed[index]:
                self._grads[index] = add_into(current, grad)
            else:
                self._grads[index] = current + grad
                summed[index] = True


StageRuns = Mapping[PipelineStage, StageRun]
"""A run's ``StageRun`` of each of its stages (in this process)."""


def _name_of(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _described(value: object) -> str:
    """``"Tensor of shape (2, 3)"``, or ``"float"`` for a value without a shape."""
    shape = _shape_of(value)
    kind = type(value).__name__
    return kind if shape is None else f"{kind} of shape {shape}"


def _shape_of(value: object) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)
