"""Where each engine's workers sit in a weight-transfer group (``RankLayout``, the one place it is
computed; ``EngineSize`` counts an engine's workers, ``worker_index`` places one among them), and
``LayoutError``: engines that do not fit, on this machine's devices or in a group's ranks."""

from __future__ import annotations

import attrs

__all__ = ["EngineSize", "LayoutError", "RankLayout", "worker_index"]


class LayoutError(ValueError):
    """The requested engines do not fit: on this machine's devices (``devices.py``), or in the
    ranks of a weight-transfer group (``RankLayout``)."""


@attrs.frozen
class EngineSize:
    """One engine's parallel sizes: tensor x pipeline workers per data-parallel rank, and its
    data-parallel ranks (vLLM's DP inside one engine: each rank a copy of the model, or with
    ``--enable-expert-parallel`` its share of the experts; vLLM balances requests among them)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @classmethod
    def of(cls, value) -> EngineSize:
        """An ``EngineSize``, or one from a (tensor, pipeline[, data]) tuple."""
        return value if isinstance(value, cls) else cls(*value)

    @property
    def workers(self) -> int:
        return self.tensor * self.pipeline * self.data

    def describe(self) -> dict:
        return {
            "tensor_parallel_size": self.tensor,
            "pipeline_parallel_size": self.pipeline,
            "data_parallel_size": self.data,
        }

    def __str__(self) -> str:
        return f"tp {self.tensor} x pp {self.pipeline}" + (f" x dp {self.data}" if self.data > 1 else "")


def worker_index(parallel_config) -> int:
    """A worker's place among its engine's workers, from vLLM's ``ParallelConfig`` in the worker:
    data-parallel ranks in order, each one's tp x pp workers in vLLM's rank order, as vLLM's own
    NCCL receivers number them (``data_parallel_index``: ``data_parallel_rank`` is 0 in every rank
    of a model without experts)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


@attrs.frozen
class RankLayout:
    """The trainer is rank 0. Each engine's workers (tp x pp x dp of them) take consecutive ranks after
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
