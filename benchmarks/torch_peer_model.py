"""The model, batch and saved-bytes counter of ``bench_torch_peer.py``, and torch's contender.

``Model`` describes a stack of pre-norm residual MLP blocks and its batch (``MODELS``: the
``--model`` choices, described in ``bench_torch_peer.py``'s docstring; ``QUICK``:
``--quick``'s). ``build_modules`` builds the stage modules from seed 0 and ``model_data``
the whole batch (inputs, targets) from seed 1, the same in every process, so that every
contender trains the same weights on the same data. ``SavedBytes`` counts the peak bytes
of the storages autograd saves for backward; ``PeerRunner`` runs this rank's stages under
``torch.distributed.pipelining`` with that counter around each stage forward and the loss.
``bench_torch_overhead.py`` and ``bench_swap_overhead.py`` use the same model.

torch is imported inside the functions: the benchmarks' launching process imports this
module but only starts ``torchrun``, and importing torch there would add seconds to it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MODELS",
    "QUICK",
    "Model",
    "PeerRunner",
    "SavedBytes",
    "build_modules",
    "model_data",
    "mse",
]


@dataclass(frozen=True)
class Model:
    """The model and batch: ``blocks`` blocks of width ``dim`` split over the stages;
    ``micro`` micro-batches of ``micro_batch`` sequences of ``seq`` tokens; weights and
    batch in ``dtype`` (a torch dtype's name)."""

    dim: int
    blocks: int
    micro: int
    micro_batch: int
    seq: int
    dtype: str = "float32"

    @property
    def hidden(self) -> int:
        return 4 * self.dim


MODELS = {
    "small": Model(dim=128, blocks=8, micro=8, micro_batch=8, seq=16),
    "wide": Model(dim=256, blocks=8, micro=8, micro_batch=8, seq=16),
}
"""``--model``: ``small`` is the default; ``wide`` computes four times as much per chunk
on twice the saved bytes and the same saved tensors."""
QUICK = Model(dim=64, blocks=8, micro=8, micro_batch=2, seq=8)


class SavedBytes:
    """Peak device bytes of the storages autograd saved for backward, by storage: a pack
    hook holds each saved tensor's storage until autograd drops the packed handle; a
    storage counts once (its whole size) however many saved views point into it.
    ``exclude``: storages never counted (parameters, buffers). ``batches``: the storages
    of the whole-batch inputs and targets; torch's micro-batches are views of them, which
    count by their own extent, as ppswap's micro-batches (copies, one storage each) do."""

    def __init__(self, exclude: set[int], batches: set[int]) -> None:
        self.exclude = exclude
        self.batches = batches
        self.holders: dict[Hashable, int] = {}
        self.sizes: dict[Hashable, int] = {}
        self.resident = 0
        self.peak = 0
        self.enabled = False

    def pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return tensor
        if ptr in self.batches:  # a micro-batch: its own extent, keyed by its offset
            key = (ptr, tensor.storage_offset())
            return _Held(self, tensor, key, tensor.numel() * tensor.element_size())
        return _Held(self, tensor, ptr, storage.nbytes())

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Held) else packed

    def hold(self, ptr: Hashable, nbytes: int) -> None:
        count = self.holders.get(ptr, 0)
        if count == 0:
            self.sizes[ptr] = nbytes
            self.resident += nbytes
            self.peak = max(self.peak, self.resident)
        self.holders[ptr] = count + 1

    def drop(self, ptr: Hashable) -> None:
        count = self.holders[ptr] - 1
        if count:
            self.holders[ptr] = count
            return
        del self.holders[ptr]
        self.resident -= self.sizes.pop(ptr)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """The hooks while ``enabled``; nothing otherwise (timed steps run without them)."""
        if not self.enabled:
            yield
            return
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class _Held:
    """A saved tensor held for backward; counted while autograd keeps this handle."""

    __slots__ = ("counter", "ptr", "tensor")

    def __init__(self, counter: SavedBytes, tensor: Any, ptr: Hashable, nbytes: int) -> None:
        self.counter, self.tensor, self.ptr = counter, tensor, ptr
        counter.hold(ptr, nbytes)

    def __del__(self) -> None:
        self.counter.drop(self.ptr)


def build_modules(model: Model, stage_num: int, *, wrap: bool) -> list[Any]:
    """``stage_num`` stage modules (``model.blocks // stage_num`` blocks each) from seed 0;
    ``wrap``: each block ``swap_wrapper``-ed."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ppswap.swap import swap_wrapper

    class Block(nn.Module):
        """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(model.dim)
            self.fc1 = nn.Linear(model.dim, model.hidden)
            self.fc2 = nn.Linear(model.hidden, model.dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
            return out

    per_stage = model.blocks // stage_num
    dtype = getattr(torch, model.dtype)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return [
            nn.Sequential(
                *(swap_wrapper(Block()) if wrap else Block() for _ in range(per_stage))
            ).to(dtype)
            for _ in range(stage_num)
        ]


def mse(output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(output, target)


def model_data(model: Model) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (model.micro * model.micro_batch, model.seq, model.dim)
    dtype = getattr(torch, model.dtype)
    x, y = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    return x.to(dtype), y.to(dtype)


class PeerRunner:
    """torch.distributed.pipelining for one schedule on this rank, with the saved-bytes
    counter around every stage forward and the loss (off unless ``counter.enabled``)."""

    def __init__(
        self, schedule: str, model: Model, rank: int, pp: int, stage_num: int, batch: Sequence[Any]
    ) -> None:
        import torch
        from torch import nn
        from torch.distributed import pipelining

        modules = build_modules(model, stage_num, wrap=False)
        self.mine = [s for s in range(stage_num) if s % pp == rank]
        self.modules = [modules[s] for s in self.mine]
        self.has_first, self.has_last = 0 in self.mine, stage_num - 1 in self.mine
        state = [t for m in self.modules for t in (*m.parameters(), *m.buffers())]
        self.counter = SavedBytes(
            {t.untyped_storage().data_ptr() for t in state},
            {t.untyped_storage().data_ptr() for t in batch},
        )
        counter = self.counter

        class Counted(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                with counter.counting():
                    out: torch.Tensor = self.inner(x)
                return out

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            with counter.counting():
                value: torch.Tensor = mse(output, target)
            return value

        cpu = torch.device("cpu")
        stages: list[Any] = [
            pipelining.PipelineStage(Counted(m), s, stage_num, cpu)
            for s, m in zip(self.mine, self.modules, strict=True)
        ]
        if schedule == "interleaved_1f1b":
            self.runner: Any = pipelining.ScheduleInterleaved1F1B(
                stages, n_microbatches=model.micro, loss_fn=loss
            )
        else:
            kind: Callable[..., Any] = {
                "gpipe": pipelining.ScheduleGPipe,
                "1f1b": pipelining.Schedule1F1B,
            }[schedule]
            self.runner = kind(stages[0], n_microbatches=model.micro, loss_fn=loss)

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)

    def step(self, x: Any, y: Any) -> list[float]:
        losses: list[Any] = []
        args = (x,) if self.has_first else ()
        if self.has_last:
            self.runner.step(*args, target=y, losses=losses)
        else:
            self.runner.step(*args)
        return [float(loss.detach()) for loss in losses]
