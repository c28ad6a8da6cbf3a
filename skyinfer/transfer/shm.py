"""Weights through POSIX shared memory, for a trainer colocated with the engines on CPU: both sides.

The trainer packs the tensors into one segment in ``/dev/shm`` (each at an aligned offset), and
one ``/update_weights`` names the segment and the offsets; every engine worker maps the segment
read-only and loads the tensors straight from it through vLLM's layerwise reload. No byte
crosses a socket. The segment is unlinked as soon as the update call returns (the engines'
mappings keep what they still read), by the trainer and by the server, whichever comes first;
the server also removes its trainers' leftovers whenever an update ends, however it ends::

    trainer = SharedMemoryTrainer("http://127.0.0.1:8000")   # a server started with --colocate
    trainer.init()
    trainer.push(model.state_dict().items(), version="step-17")
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
import warnings
from collections.abc import Iterator

import torch

from ..client import Client
from .packing import dtype_from_name
from .protocol import (
    SEGMENT_ALIGNMENT,
    SharedMemoryInitInfo,
    SharedMemoryUpdateInfo,
    segment_path,
)
from .pushing import NamedTensors, OneCall, Trainer, update_weights_call
from .receiving import LayerwiseReceiver

# -- the trainer's side ---------------------------------------------------------------


def layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    """Each tensor's offset in the segment, aligned, and the segment's size."""
    offsets, end = [], 0
    for _name, tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
    return offsets, max(end, SEGMENT_ALIGNMENT)


def write_segment(name: str, tensors: list[torch.Tensor], offsets: list[int], size: int) -> None:
    """A new segment holding ``tensors`` at ``offsets``; removed by whoever made it (or the server)."""
    path = segment_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, size)
        for tensor, offset in zip(tensors, offsets):
            # One copy, by the kernel, into pages it allocates as it goes: measured twice as
            # fast here as faulting them in through a mapping (tools/bench_weight_sync.py).
            os.pwrite(fd, tensor.reshape(-1).view(torch.uint8).numpy(), offset)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def written_segment(
    name: str, tensors: list[tuple[str, torch.Tensor]], offsets: list[int], size: int
) -> Iterator[None]:
    """A new segment holding ``tensors`` at ``offsets``, for the duration of the block; unlinked
    afterwards, whatever happens in it."""
    write_segment(name, [tensor for _name, tensor in tensors], offsets, size)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(name))


class SharedMemoryTrainer(Trainer):
    """A trainer on the same machine as a colocated skyinfer server (``--colocate``) on CPU: it
    pushes from its own memory through one shared-memory segment per push."""

    def __init__(
        self, base_url: str, *, admin_key: str | None = None, timeout_s: float = 120.0, client: Client | None = None
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client)
        self._prefix: str | None = None

    def init(self) -> None:
        """Tell the engines a trainer pushes through shared memory; learn the segment names this server takes."""
        self._prefix = self.client.init_weight_transfer_engine({"timeout_s": self.timeout_s})["segment_prefix"]

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        if self._prefix is None:
            raise RuntimeError("call init() first")
        return [(name, t.detach().cpu().contiguous()) for name, t in named_tensors]

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        offsets, size = layout(tensors)
        name = f"{self._prefix}{uuid.uuid4().hex}"
        with written_segment(name, tensors, offsets, size):
            update_weights_call(self._calls, {**metadata, "segment": name, "offsets": offsets}, one_call)


# -- the engines' side ----------------------------------------------------------------


def map_segment(name: str, size: int) -> torch.Tensor:
    """The segment's first ``size`` bytes as a uint8 tensor over a read-only mapping, which lasts
    as long as some tensor views it."""
    fd = os.open(segment_path(name), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(
                f"segment {name!r} holds {os.fstat(fd).st_size} bytes, fewer than the {size} the update names"
            )
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # Read-only on purpose: vLLM's loaders copy from the tensors they are given, never into them.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=torch.uint8)


class SharedMemoryReceiver(LayerwiseReceiver):
    """vLLM's weight-transfer backend interface, for shared memory (receiving.py: how it joins vLLM)."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        pass  # no rendezvous: every update names its own segment

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        buffer = map_segment(update_info.segment, update_info.end())
        tensors = []
        for i, (name, dtype, shape, offset) in enumerate(
            zip(update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets)
        ):
            view = buffer[offset : offset + update_info.nbytes(i)]
            tensors.append((name, view.view(dtype_from_name(dtype)).view(shape)))
        self.model.load_weights(tensors)

    def shutdown(self) -> None:
        pass
