"""DeviceMesh: the data-parallel x pipeline-parallel layout of a run's ranks.

A mesh of ``pp`` pipeline ranks and ``dp`` data-parallel replicas has ``pp * dp`` ranks.
World rank ``w`` has the coordinates ``pp_index = w % pp`` and ``dp_index = w // pp``: the
ranks of one pipeline replica are contiguous (``d * pp .. d * pp + pp - 1``), so replica 0
numbers its ranks exactly as a pp-only run does. Rank ``w`` runs the finalized order of
pipeline rank ``w % pp`` (every replica runs the same schedule); its P2P peers are the
ranks of its own replica (``peer + d * pp``), and its dp group, the ranks FSDP gathers
and reduces with, is ``(w % pp) + d * pp`` for ``d = 0 .. dp - 1``, in dp order.

Expert parallelism (``ep``, default 1, must divide ``dp``): consecutive blocks of ``ep``
replicas form an EP group; replica ``d`` is EP rank ``d % ep`` of EP group ``d // ep``.
The EP group of rank ``w`` (the ranks a MoE block exchanges tokens with) is the ``ep``
ranks of its pipeline rank in that block; its expert-replica group (the ranks holding
the same experts, whose expert gradients are summed) is the ``dp // ep`` ranks of its
pipeline rank with the same EP rank.
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
    """Where a world rank sits: pipeline rank ``pp`` of data-parallel replica ``dp``,
    EP rank ``ep`` (``dp % mesh.ep``) of its EP group."""

    pp: int
    dp: int
    ep: int = 0


@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """``pp`` pipeline ranks times ``dp`` data-parallel replicas, ``ep`` of which form
    an EP group (module docstring)."""

    pp: int
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _check_size("pp", self.pp)
        _check_size("dp", self.dp)
        _check_size("ep", self.ep)
        if self.dp % self.ep:
            raise ValueError(
                f"DeviceMesh.ep must divide dp (an EP group is ep replicas of one pipeline "
                f"rank), got ep={self.ep} for dp={self.dp}"
            )

    def __repr__(self) -> str:
        ep = "" if self.ep == 1 else f", ep={self.ep}"
        return f"DeviceMesh(pp={self.pp}, dp={self.dp}{ep})"

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
        dp_index = rank // self.pp
        return MeshCoords(pp=rank % self.pp, dp=dp_index, ep=dp_index % self.ep)

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """The world ranks holding the same pipeline rank as ``rank``, in dp order."""
        pp_index = self.coords(rank).pp
        return tuple(pp_index + d * self.pp for d in range(self.dp))

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The world ranks a MoE block of ``rank`` exchanges tokens with (itself
        included), in EP rank order: its pipeline rank in the ``ep`` replicas of its
        block."""
        coords = self.coords(rank)
        first = coords.dp - coords.ep
        return tuple(coords.pp + (first + e) * self.pp for e in range(self.ep))

    def expert_replica_group(self, rank: int) -> tuple[int, ...]:
        """The world ranks holding the same experts as ``rank`` (its pipeline rank, its
        EP rank, in every EP group), in dp order: expert gradients are summed over it."""
        coords = self.coords(rank)
        return tuple(
            coords.pp + (g * self.ep + coords.ep) * self.pp for g in range(self.dp // self.ep)
        )

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
