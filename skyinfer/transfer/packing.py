"""Packing of many tensors into few broadcasts, by the rule vLLM's ``packed_tensor`` uses.

Each tensor is flattened to bytes and appended to the current chunk; a chunk
is closed as soon as it holds *more* than ``buffer_size_bytes`` (so a chunk
ends with the tensor that crossed the limit). Sender and receivers cut the
same stream of (name, shape, dtype) at the same places without talking,
which is why both sides use this one module. Needs only torch: the trainer
side must not import vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import attrs
import torch

from .protocol import DEFAULT_BUFFER_SIZE_BYTES, DTYPE_SIZES

__all__ = [
    "DEFAULT_BUFFER_SIZE_BYTES",
    "GLOO_BUCKET_BYTES",
    "TensorMeta",
    "dtype_from_name",
    "dtype_name",
    "pack",
    "pack_into",
    "plan_chunks",
    "unpack",
]

# ``GlooTrainer``'s buckets: tens of MiB, so that a worker receives the next while it loads one (a
# CPU's copies are slow beside a GPU's; vLLM's default, one GiB, puts a model of a few hundred MiB
# in one bucket, and nothing then overlaps).
GLOO_BUCKET_BYTES = 32 * 2**20


@attrs.frozen
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (as vLLM's ``dtype_names`` carry it) to ``torch.bfloat16``; only the dtypes a
    push may carry (``protocol.DTYPE_SIZES``)."""
    name = name.removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_chunks(metas: Iterable[TensorMeta], buffer_size_bytes: int) -> Iterator[list[TensorMeta]]:
    """Group tensors into the chunks a packed transfer broadcasts."""
    chunk: list[TensorMeta] = []
    total = 0
    for meta in metas:
        chunk.append(meta)
        total += meta.nbytes
        if total > buffer_size_bytes:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def _as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(-1).view(torch.uint8) for t in tensors]


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous uint8 buffer holding the tensors' bytes back to back."""
    return torch.cat(_as_bytes(tensors))


def pack_into(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``pack`` into the start of ``buffer`` (uint8, large enough): the part of it written."""
    parts = _as_bytes(tensors)
    return torch.cat(parts, out=buffer[: sum(p.numel() for p in parts)])


def unpack(buffer: torch.Tensor, chunk: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors in a received buffer (views into it)."""
    parts = buffer.split([m.nbytes for m in chunk])
    return [(m.name, part.view(m.dtype).view(m.shape)) for m, part in zip(chunk, parts)]
