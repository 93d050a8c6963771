"""DeviceMesh: the data-parallel x pipeline-parallel layout of a run's ranks.

A mesh of ``pp`` pipeline ranks and ``dp`` data-parallel replicas has ``pp * dp`` ranks.
World rank ``w`` has the coordinates ``pp_index = w % pp`` and ``dp_index = w // pp``: the
ranks of one pipeline replica are contiguous (``d * pp .. d * pp + pp - 1``), so replica 0
numbers its ranks exactly as a pp-only run does. Rank ``w`` runs the finalized order of
pipeline rank ``w % pp`` (every replica runs the same schedule); its P2P peers are the
ranks of its own replica (``peer + d * pp``), and its dp group, the ranks FSDP gathers
and reduces with, is ``(w % pp) + d * pp`` for ``d = 0 .. dp - 1``, in dp order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppswap.scheduler.steps import MetaStep, Order

__all__ = ["DeviceMesh", "MeshCoords", "order_for_world_rank"]


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"DeviceMesh.{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"DeviceMesh.{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class MeshCoords:
    """Where a world rank sits: pipeline rank ``pp`` of data-parallel replica ``dp``."""

    pp: int
    dp: int


@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """``pp`` pipeline ranks times ``dp`` data-parallel replicas (module docstring)."""

    pp: int
    dp: int = 1

    def __post_init__(self) -> None:
        _check_size("pp", self.pp)
        _check_size("dp", self.dp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def rank_of(self, pp_index: int, dp_index: int) -> int:
        """The world rank of pipeline rank ``pp_index`` in replica ``dp_index``."""
        self._check_index("pp_index", pp_index, self.pp)
        self._check_index("dp_index", dp_index, self.dp)
        return dp_index * self.pp + pp_index

    def coords(self, rank: int) -> MeshCoords:
        """The (pp, dp) coordinates of world rank ``rank``."""
        self._check_index("rank", rank, self.world_size)
        return MeshCoords(pp=rank % self.pp, dp=rank // self.pp)

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """The world ranks holding the same pipeline rank as ``rank``, in dp order."""
        pp_index = self.coords(rank).pp
        return tuple(pp_index + d * self.pp for d in range(self.dp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        """The world ranks of ``rank``'s pipeline replica, in pipeline order."""
        base = self.coords(rank).dp * self.pp
        return tuple(range(base, base + self.pp))

    def _check_index(self, name: str, value: object, bound: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int in 0..{bound - 1}, got {value!r}")
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in 0..{bound - 1} for {self!r}, got {value!r}")


def _offset_peers(step: MetaStep, offset: int) -> MetaStep:
    sub_steps = tuple(_offset_peers(sub, offset) for sub in step.sub_steps)
    peer = None if step.peer is None else step.peer + offset
    if peer == step.peer and sub_steps == step.sub_steps:
        return step
    return MetaStep(step.kind, step.stage, step.micro, peer, sub_steps)


def order_for_world_rank(order: Order, mesh: DeviceMesh, rank: int) -> Order:
    """The pipeline rank's ``order`` as world rank ``rank`` runs it: every P2P peer (a
    pipeline rank) becomes the world rank of that pipeline rank in ``rank``'s replica.
    Pure: returns a new order (the same one for replica 0)."""
    offset = mesh.coords(rank).dp * mesh.pp
    if offset == 0:
        return order
    return tuple(_offset_peers(step, offset) for step in order)
