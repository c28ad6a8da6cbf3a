"""Weights through POSIX shared memory, for a trainer colocated with the engines on CPU: both sides.

The trainer packs the tensors into one segment in ``/dev/shm`` (each at an aligned offset), and
one ``/update_weights`` names the segment and the offsets; every engine worker maps the segment
read-only and loads the tensors straight from it (``receiving``). No byte crosses a socket.

The segment is made once, its pages allocated then, and every later push that fits it is written
into the same pages (``reuse``: a new file cost the kernel 0.17 s of page allocation per 352 MiB
here, five times the copy); each worker keeps its mapping from one push to the next. The server
leaves a reused segment in place after a push that finished and removes it with every other
segment of its trainers when an update is aborted or abandoned, at a new init and when it stops
(what a trainer killed between two pushes leaves stays until then); the trainer removes it at
``close`` or as its interpreter exits, and makes a new one when the server removed it. A push of a
trainer that does not reuse its segment (``reuse`` false) has it unlinked as soon as its update
call returns (the engines' mappings keep what they still read)::

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
import weakref

import torch

from ..client import Client
from .packing import dtype_from_name
from .protocol import (
    SEGMENT_ALIGNMENT,
    SharedMemoryInitInfo,
    SharedMemoryUpdateInfo,
    segment_path,
)
from .pushing import NamedTensors, OneCall, Trainer
from .receiving import LiveReceiver

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


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Segment:
    """A trainer's segment, made once with its pages allocated, mapped for writing; every push
    that fits it is written into the same pages. Its name goes at ``close``, or when the segment
    is collected or the interpreter exits without one; a trainer killed leaves it to the server."""

    def __init__(self, name: str, size: int) -> None:
        path = segment_path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # every page now, once
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.name, self.size, self._fd = name, size, fd
        # Its pages, for writing into (a colocated IPC trainer packs into them: ipc.py).
        self.bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._unlink = weakref.finalize(self, _unlink_quietly, path)

    def removed(self) -> bool:
        """Whether its name is gone (the server removes it when an update is aborted, and at an init)."""
        return os.fstat(self._fd).st_nlink == 0

    def write(self, tensors: list[torch.Tensor], offsets: list[int]) -> None:
        for tensor, offset in zip(tensors, offsets):
            source = tensor.reshape(-1).view(torch.uint8)
            self.bytes[offset : offset + source.numel()].copy_(source)

    def close(self) -> None:
        self._unlink()
        del self.bytes  # the mapping closes only once no tensor views it
        self._mapping.close()
        os.close(self._fd)


class SharedMemoryTrainer(Trainer):
    """A trainer on the same machine as a colocated skyinfer server (``--colocate``) on CPU: it
    pushes from its own memory through one shared-memory segment, made at its first push and
    written again by each push that fits it (the module's docstring: who removes it)."""

    def __init__(
        self, base_url: str, *, admin_key: str | None = None, timeout_s: float = 120.0, client: Client | None = None
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client)
        self._prefix: str | None = None
        self._segment: Segment | None = None

    def init(self) -> None:
        """Tell the engines a trainer pushes through shared memory; learn the segment names this server takes."""
        self._prefix = self.client.init_weight_transfer_engine({"timeout_s": self.timeout_s})["segment_prefix"]

    def close(self) -> None:
        """Remove the segment and close the HTTP connections."""
        self._drop_segment()
        super().close()

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        if self._prefix is None:
            raise RuntimeError("call init() first")
        return [(name, t.detach().cpu().contiguous()) for name, t in named_tensors]

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        offsets, size = layout(tensors)
        segment = self._segment_for(size)
        segment.write([tensor for _name, tensor in tensors], offsets)
        update_info = {**metadata, "segment": segment.name, "offsets": offsets, "reuse": True}
        self._update_weights(update_info, one_call)

    def _segment_for(self, size: int) -> Segment:
        """The segment, if it is still there and fits ``size`` bytes; else a new one of this server's."""
        if self._segment is not None and (self._segment.size < size or self._segment.removed()):
            self._drop_segment()
        if self._segment is None:
            self._segment = Segment(f"{self._prefix}{uuid.uuid4().hex}", size)
        return self._segment

    def _drop_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


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


class SharedMemoryReceiver(LiveReceiver):
    """vLLM's weight-transfer backend interface, for shared memory (receiving.py: how it joins vLLM).
    The mapping of the segment the last update named is kept for the next that names it (the same
    file: a segment removed and made again under its name is mapped again), until an update names
    another or the transfer is shut down."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    # (segment name, its inode, its size): its mapping.
    _mapped: tuple[tuple[str, int, int], torch.Tensor] | None = None

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        self._mapped = None  # no rendezvous: every update names its segment

    def _map(self, name: str, size: int) -> torch.Tensor:
        stat = os.stat(segment_path(name))
        key = (name, stat.st_ino, stat.st_size)
        if self._mapped is None or self._mapped[0] != key:
            self._mapped = None  # the old mapping goes before the new one is made
            self._mapped = (key, map_segment(name, stat.st_size))
        if stat.st_size < size:
            raise ValueError(f"segment {name!r} holds {stat.st_size} bytes, fewer than the {size} the update names")
        return self._mapped[1]

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        buffer = self._map(update_info.segment, update_info.end())
        tensors = []
        for i, (name, dtype, shape, offset) in enumerate(
            zip(update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets)
        ):
            view = buffer[offset : offset + update_info.nbytes(i)]
            tensors.append((name, view.view(dtype_from_name(dtype)).view(shape)))
        self.load(tensors)

    def drop_kept(self) -> None:
        self._mapped = None

    def shutdown(self) -> None:
        self._mapped = None
