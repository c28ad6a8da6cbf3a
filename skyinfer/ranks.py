"""Where each engine's workers sit in a weight-transfer group (``RankLayout``, the one place it is
computed), and ``LayoutError``: engines that do not fit, on this machine's devices or in a group's ranks."""

from __future__ import annotations

import attrs

__all__ = ["LayoutError", "RankLayout"]


class LayoutError(ValueError):
    """The requested engines do not fit: on this machine's devices (``devices.py``), or in the
    ranks of a weight-transfer group (``RankLayout``)."""


@attrs.frozen
class RankLayout:
    """The trainer is rank 0. Each engine's workers (tp x pp of them) take consecutive ranks after
    the ranks before them. A client's ``rank_offset`` is where this server's workers start: 1 for a
    single node (what vLLM's trainer helpers send); on node k of several, 1 plus the workers of the
    nodes before (``MultiNodeClient``)."""

    base_offset: int
    world_size: int
    workers_per_engine: tuple[int, ...]

    @classmethod
    def build(cls, base_offset: int, world_size: int, workers_per_engine: tuple[int, ...]) -> RankLayout:
        if base_offset < 1:
            raise LayoutError(f"rank_offset must be at least 1 (the trainer is rank 0); got {base_offset}")
        needed = base_offset + sum(workers_per_engine)
        if world_size < needed:
            raise LayoutError(
                f"world_size {world_size} is too small: with rank_offset {base_offset} this server's "
                f"{sum(workers_per_engine)} worker(s) need ranks up to {needed - 1}, so world_size >= {needed} "
                f"(GET /get_world_size gives this server's worker count)"
            )
        return cls(base_offset, world_size, workers_per_engine)

    def rank_offset(self, engine_index: int) -> int:
        return self.base_offset + sum(self.workers_per_engine[:engine_index])
