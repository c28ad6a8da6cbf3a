"""Weights through CUDA IPC, for a trainer colocated with the engines on GPUs: both sides.

NCCL cannot put two ranks of one group on one GPU, so a trainer sharing its GPUs with the
engines hands them its tensors instead: for each tensor, the arguments of torch's
``rebuild_cuda_tensor`` (what ``reduce_tensor`` gives), from which each engine worker maps the
trainer's memory on its own GPU and loads it through vLLM's ``ipc`` backend. vLLM's own HTTP
client pickles those arguments (``ipc_handles_pickled``); skyinfer carries them as JSON it
defines (``protocol.IpcHandle``: handle bytes in base64, classes and dtype by name), checked
field by field, so no pickle crosses the wire. A server started with ``--allow-pickled-ipc``
also takes vLLM's pickled body, as vLLM does with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

The device primitive is the handle: CUDA's (``reduce_tensor`` on the trainer, ``rebuild_cuda_tensor``
in each worker). On a CPU, where CUDA has none, a POSIX shared-memory segment of the trainer's takes
its place in the same fields (its name as the storage handle, each tensor at its offset in it),
removed when the push ends, by the trainer, or by the server as for the shared-memory transport:
a CPU server started with ``--colocate --weight-transport ipc`` (the test suite's) runs every other
line of this path as a GPU does.

A multi-rank trainer (torch.distributed, one rank per GPU) calls ``push`` on every rank: each
exports the handles of its own GPU's copy, every rank gathers them all before any server call, and
rank 0 alone sends one update carrying all of them; each engine worker takes the handle of its GPU.
Rank 0 then tells the other ranks how its calls went (``Ranks``), so every rank returns or every
rank raises the server's refusal: none is left waiting in a collective for a rank that gave up::

    trainer = IPCTrainer("http://127.0.0.1:8000")   # a server started with --colocate, on GPUs
    trainer.init()
    trainer.push(model.state_dict().items(), version="step-17")
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import pickle
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..client import Client, SkyinferError
from .packing import TensorMeta, dtype_from_name, pack_into, unpack
from .protocol import HOST_MEMORY_UUID, IpcHandle, IpcInitInfo, IpcUpdateInfo, checked_segment_name, segment_path
from .pushing import NamedTensors, OneCall, Trainer
from .receiving import LiveReceiver
from .shm import Segment, layout, map_segment, write_segment

# -- the JSON form of torch's rebuild_cuda_tensor arguments ----------------------------------


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def encode_handle(rebuild_args: Sequence) -> dict:
    """``reduce_tensor``'s arguments for one CUDA tensor, as the JSON ``IpcHandle`` describes."""
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = rebuild_args
    return {
        "tensor_class": tensor_cls.__name__,
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "storage_class": storage_cls.__name__,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "storage_handle": _b64(storage_handle),
        "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "requires_grad": requires_grad,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": event_sync_required,
    }


_TENSOR_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def decode_handle(handle: IpcHandle) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` back from a checked ``IpcHandle``."""
    return (
        _TENSOR_CLASSES[handle.tensor_class],
        torch.Size(handle.size),
        tuple(handle.stride),
        handle.offset,
        _STORAGE_CLASSES[handle.storage_class],
        getattr(torch, handle.dtype),
        handle.device,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.requires_grad,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        None if handle.event_handle is None else base64.b64decode(handle.event_handle),
        handle.event_sync_required,
    )


# -- the device primitive: a tensor's handle, made and opened ---------------------------------

# On a GPU, CUDA IPC, as torch exports and opens it.


def _cuda_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _export_cuda(tensors: list[torch.Tensor]) -> list[tuple]:
    from torch.multiprocessing.reductions import reduce_tensor

    return [reduce_tensor(t)[1] for t in tensors]


def _open_cuda(args: Sequence, device: torch.device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    opened = list(args)
    opened[6] = device.index  # the handle names the exporter's device index; this worker's is its own
    return rebuild_cuda_tensor(*opened)


def _release_cuda_exports() -> None:
    torch.cuda.ipc_collect()


# By device, on either side.


def device_uuid(device: torch.device) -> str:
    """The key of a device's handles: the GPU's UUID, as torch prints it; host memory's stand-in on CPU."""
    return _cuda_uuid(device) if device.type == "cuda" else HOST_MEMORY_UUID


def _host_handle(tensor: torch.Tensor, offset_bytes: int, segment: str, size: int) -> tuple:
    """The stand-in for ``reduce_tensor``'s arguments: ``tensor`` at ``offset_bytes`` in ``segment``
    (``size`` bytes), its name as the storage handle."""
    name = segment.encode()
    return (torch.Tensor, tensor.size(), tensor.stride(), offset_bytes // tensor.element_size(), torch.UntypedStorage,
            tensor.dtype, 0, name, size, 0, False, name, 0, None, False)  # fmt: skip


def export_handles(tensors: list[torch.Tensor], segment: str | None = None) -> list[tuple]:
    """The arguments that open each of ``tensors`` in another process: ``reduce_tensor``'s for CUDA
    tensors; for CPU ones, the same fields for a new shared-memory ``segment`` that holds them all
    (its name as the storage handle, each tensor at an aligned offset; the caller removes it)."""
    if segment is None:
        return _export_cuda(tensors)
    offsets, size = layout([("", t) for t in tensors])
    write_segment(segment, tensors, offsets, size)
    return [_host_handle(t, offset, segment, size) for t, offset in zip(tensors, offsets)]


@attrs.define(eq=False)
class PackedBuffer:
    """A trainer's packed buffer, made and exported once, into which every push that fits it is
    packed: device memory on a GPU; on a CPU, the stand-in, a shared-memory segment made once."""

    tensor: torch.Tensor | None
    # {this device's uuid: the buffer's handle}, as the JSON ``IpcHandle`` describes it.
    handle: dict[str, dict]
    segment: Segment | None = None

    @classmethod
    def make(cls, nbytes: int, device: torch.device, segment_prefix: str | None) -> PackedBuffer:
        if device.type == "cuda":
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return cls(tensor, {device_uuid(device): encode_handle(_export_cuda([tensor])[0])})
        if segment_prefix is None:
            raise RuntimeError("call init() first: the server names the segments it takes")
        segment = Segment(f"{segment_prefix}{uuid.uuid4().hex}", nbytes)
        handle = _host_handle(segment.bytes, 0, segment.name, segment.size)
        return cls(segment.bytes, {device_uuid(device): encode_handle(handle)}, segment)

    def fits(self, nbytes: int) -> bool:
        """Whether a push of ``nbytes`` goes in (and, on a CPU, the server left its segment in place)."""
        return self.tensor.numel() >= nbytes and (self.segment is None or not self.segment.removed())

    def close(self) -> None:
        self.tensor = None  # the segment's mapping closes once nothing views it
        if self.segment is not None:
            self.segment.close()


def open_handle(args: Sequence, device: torch.device) -> torch.Tensor:
    """The tensor another process exported (``export_handles``), mapped here without a copy: on a
    GPU through CUDA IPC, onto ``device``; on a CPU from the shared-memory segment it names."""
    if device.type == "cuda":
        return _open_cuda(args, device)
    _cls, size, stride, offset, _storage_cls, dtype, _device, segment, nbytes, *_ = args
    buffer = map_segment(checked_segment_name(segment.decode()), nbytes)
    return buffer[: nbytes - nbytes % dtype.itemsize].view(dtype).as_strided(size, stride, offset)


# -- a multi-rank trainer's ranks, in step ----------------------------------------------


@dataclass(frozen=True)
class _Failure:
    """What one rank raised, as it travels to the others (a ``SkyinferError`` does not pickle)."""

    kind: str
    message: str
    status: int | None = None
    body: Any = None

    @classmethod
    def of(cls, exc: BaseException) -> _Failure:
        if isinstance(exc, SkyinferError):
            return cls("SkyinferError", exc.message, exc.status, exc.body)
        return cls(type(exc).__name__, str(exc))

    def error(self, rank: int) -> Exception:
        """The error a rank raises for this failure of ``rank``: the server's refusal as the client
        raised it (so that ``status`` and ``code`` read the same on every rank), anything else named."""
        if self.status is not None:
            return SkyinferError(self.status, self.message, self.body)
        return RuntimeError(f"rank {rank} failed: {self.kind}: {self.message}")


class Ranks:
    """The ranks of a multi-rank trainer that push together: torch.distributed's ``group`` (the
    default group unless given), over any backend. Rank 0 alone talks to the server; every rank
    takes part in the same collectives in the same order whatever the server or a rank's own
    export does, so that no rank waits for ever on one that has given up: one gather of every
    rank's handles before any server call (``gather``), then one broadcast of how rank 0's calls
    went (``agree``)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._agreeing = False

    @property
    def alone(self) -> bool:
        return not dist.is_available() or not dist.is_initialized() or dist.get_world_size(self.group) == 1

    @property
    def leads(self) -> bool:
        return self.alone or dist.get_rank(self.group) == 0

    def gather(self, export: Callable[[], list[dict[str, dict]]]) -> list[dict[str, dict]]:
        """Every rank's ``export`` (one ``{device uuid: handle}`` per tensor) merged per tensor, on
        every rank. A rank whose export fails still takes part, with its failure: then every rank
        raises (that rank its own error), before the server hears of the push."""
        if self.alone:
            return export()
        try:
            mine: list[dict[str, dict]] | _Failure = export()
        except Exception as exc:
            own_error, mine = exc, _Failure.of(exc)
        else:
            own_error = None
        everyone: list[list[dict[str, dict]] | _Failure | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if own_error is not None:
            raise own_error
        for rank, theirs in enumerate(everyone):
            if isinstance(theirs, _Failure):
                raise theirs.error(rank)
        # Every rank decides from the same gathered lists, so they all go on or all raise.
        counts = [len(theirs) for theirs in everyone]
        if len(set(counts)) > 1:
            raise ValueError(f"the ranks push different numbers of tensors: {counts} (by rank)")
        return [{uuid: h for theirs in everyone for uuid, h in theirs[i].items()} for i in range(counts[0])]

    def agree(self, call: Callable[[], None]) -> None:
        """Rank 0 makes ``call`` (its server calls) and tells every rank how it went: they all
        return, or all raise rank 0's error. Rank 0 calling ``agree`` again inside ``call`` (setting
        the transfer up again in a push) makes no collective: the others wait for the outer outcome."""
        if self.alone or self._agreeing:
            call()
            return
        leader = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if not self.leads:
            outcome: list[_Failure | None] = [None]
            dist.broadcast_object_list(outcome, src=leader, group=self.group)
            if outcome[0] is not None:
                raise outcome[0].error(0)
            return
        failure: _Failure | None = None
        self._agreeing = True
        try:
            call()
        except BaseException as exc:  # an interrupt on rank 0 too: the others must not wait on
            failure = _Failure.of(exc)
            raise
        finally:
            self._agreeing = False
            dist.broadcast_object_list([failure], src=leader, group=self.group)


# -- the trainer's side ---------------------------------------------------------------


class IPCTrainer(Trainer):
    """A trainer on the same GPUs as a colocated skyinfer server (``--colocate``): pushes from its
    own GPU memory. With torch.distributed initialized, call ``init`` and ``push`` on every rank of
    ``group`` (torch's default group unless given): they return on every rank, or raise on every
    rank (a refusal of the server as ``SkyinferError``, the same on every rank).

    ``packed`` (the default): every push is packed into one buffer of the trainer's (a device copy),
    made and exported once and kept from push to push, as large as the checkpoint; each engine
    worker opens it once and keeps it open (``reuse``). Unpacked: a handle per tensor, exported and
    opened at every push, no memory beside the tensors. ``close`` lets the buffer go."""

    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        timeout_s: float = 120.0,
        client: Client | None = None,
        group: dist.ProcessGroup | None = None,
        packed: bool = True,
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client)
        self._ranks = Ranks(group)
        self.packed = packed
        # Packed: the buffer this rank packs every push into.
        self._buffer: PackedBuffer | None = None
        # The engines map this process's memory: the tensors must outlive the update's finish.
        self._keep: list[torch.Tensor] = []
        # Every rank's handles per tensor, gathered as the tensors are prepared.
        self._handles: list[dict[str, dict]] = []
        # On a CPU: what this server's segments are named, and the one a push exported into.
        self._segment_prefix: str | None = None
        self._segment: str | None = None

    def init(self) -> None:
        """Tell the engines a trainer pushes through CUDA IPC; on every rank, which all return or all raise."""
        self._ranks.agree(self._init_engines)

    def _init_engines(self) -> None:
        answer = self.client.init_weight_transfer_engine({"packed": self.packed, "timeout_s": self.timeout_s})
        self._segment_prefix = answer.get("segment_prefix")

    def close(self) -> None:
        """Let the packed buffer go (each engine worker holds it open until the next trainer's init)
        and close the HTTP connections."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
            self._release_exported()
        super().close()

    def _pushed(self) -> None:
        # Every rank's tensors and handles, held for the engines while they copied them.
        self._keep, self._handles = [], []
        if not self.packed:
            self._release_exported()

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        tensors: list[tuple[str, torch.Tensor]] = []

        def export() -> list[dict[str, dict]]:
            tensors.extend((name, self._on_device(t)) for name, t in named_tensors)
            if self.packed:
                return [self._packed_into(tensors)]
            self._keep.extend(t for _, t in tensors)
            return self._export_handles(tensors)

        self._handles = self._ranks.gather(export)
        return tensors

    def _packed_into(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, dict]:
        """Pack ``tensors`` into this rank's buffer (a new one where they no longer fit it, or the
        server removed a CPU's segment): its handle, the same from push to push."""
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        if self._buffer is not None and not self._buffer.fits(nbytes):
            self._buffer.close()
            self._buffer = None
            self._release_exported()
        if self._buffer is None:
            self._buffer = self._new_buffer(nbytes)
        pack_into(self._buffer.tensor, [t for _, t in tensors])
        self._copied()
        return self._buffer.handle

    def _in_group(self, send: Callable[[], None]) -> None:
        # Rank 0's calls, with the retry of Trainer._in_group (its init makes no collective there):
        # the other ranks learn only the outcome.
        self._ranks.agree(functools.partial(super()._in_group, send))

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        # Gathered when the tensors were prepared, so that a push sent again carries the same ones.
        if not self.packed:
            self._update_weights({**metadata, "ipc_handles": self._handles}, one_call)
            return
        sizes = [t.numel() * t.element_size() for _, t in tensors]
        update_info = {**metadata, "ipc_handles": self._handles[0], "tensor_sizes": sizes, "reuse": True}
        self._update_weights(update_info, one_call)

    # The device steps, apart from the ranks' choreography (a test runs that on CPU with stand-ins).

    @staticmethod
    def _device() -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self._device()).contiguous()  # on a CPU, copied into a segment when exported

    def _new_buffer(self, nbytes: int) -> PackedBuffer:
        return PackedBuffer.make(nbytes, self._device(), self._segment_prefix)

    def _copied(self) -> None:
        """The packing's copies are in the buffer before any engine is told to read it."""
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def _export_handles(self, tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, dict]]:
        """One ``{this device's uuid: handle}`` per tensor."""
        device = self._device()
        if device.type == "cpu":
            if self._segment_prefix is None:
                raise RuntimeError("call init() first: the server names the segments it takes")
            self._segment = f"{self._segment_prefix}{uuid.uuid4().hex}"
        handles = export_handles([t for _, t in tensors], self._segment)
        return [{device_uuid(device): encode_handle(args)} for args in handles]

    def _release_exported(self) -> None:
        if torch.cuda.is_available():
            _release_cuda_exports()
        if self._segment is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(self._segment))
            self._segment = None


# -- the engines' side ----------------------------------------------------------------


class IpcReceiver(LiveReceiver):
    """Each worker opens the handles of its own device (skyinfer's JSON ones, or, where the server
    allows it, vLLM's pickled ones) and loads what they map, as vLLM's ``ipc`` backend does."""

    init_info_cls = IpcInitInfo
    update_info_cls = IpcUpdateInfo

    # A packed buffer opened once for every chunk that names it (an exporter that reuses its buffer
    # ships the same handle each chunk): released at the update's finish, as vLLM's importer does,
    # or kept open for the next update when its trainer ``reuse``s it (until an update names
    # another, an init or the transfer's shutdown).
    _packed_buffer: tuple[tuple, torch.Tensor] | None = None
    _keep_open = False

    def init_transfer_engine(self, init_info: IpcInitInfo) -> None:
        # No rendezvous: each update says whether it is packed (one handle, or one per tensor). A
        # new trainer's buffer is another: the last one's goes.
        self._packed_buffer = None

    def receive_weights(self, update_info: IpcUpdateInfo) -> None:
        handles = self._handles(update_info)
        here = device_uuid(self.device)
        if isinstance(handles, dict):  # one packed buffer
            buffer = self._packed(_mine(handles, here))
            self._keep_open = update_info.reuse
            metas = [
                TensorMeta(name, dtype_from_name(dtype), tuple(shape))
                for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)
            ]
            weights = unpack(buffer[: sum(m.nbytes for m in metas)], metas)
            if not self.loads_at_once:  # copies: the exporter reuses its buffer for the next chunk
                weights = [(name, tensor.clone()) for name, tensor in weights]
        else:
            weights = [
                (name, open_handle(_mine(per, here), self.device)) for name, per in zip(update_info.names, handles)
            ]
        self.load(weights)

    @staticmethod
    def _handles(update_info: IpcUpdateInfo) -> list[dict[str, tuple]] | dict[str, tuple]:
        """Each tensor's handles (or the packed buffer's), as ``open_handle`` takes them."""
        if update_info.pickled:
            # Only a server started with --allow-pickled-ipc lets such a body through to here, and
            # only its engines are started with vLLM's own opt-in.
            if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
                raise ValueError(
                    "ipc_handles_pickled: this engine unpickles nothing (the server's --allow-pickled-ipc)"
                )
            return pickle.loads(base64.b64decode(update_info.ipc_handles_pickled))
        if isinstance(update_info.ipc_handles, dict):
            return {uuid: decode_handle(h) for uuid, h in update_info.ipc_handles.items()}
        return [{uuid: decode_handle(h) for uuid, h in per.items()} for per in update_info.ipc_handles or []]

    def _packed(self, args: tuple) -> torch.Tensor:
        key = tuple(args)
        if self._packed_buffer is None or self._packed_buffer[0] != key:
            self._packed_buffer = (key, open_handle(args, self.device).view(-1).view(torch.uint8))
        return self._packed_buffer[1]

    def finish_weight_update(self) -> None:
        try:
            super().finish_weight_update()
        finally:
            if not self._keep_open:
                self._packed_buffer = None  # the export's one release
            self._keep_open = False

    def drop_kept(self) -> None:
        self._packed_buffer = None

    def shutdown(self) -> None:
        self._packed_buffer = None


def _mine(handles: dict[str, tuple], uuid: str) -> tuple:
    if uuid not in handles:
        raise ValueError(f"no handle for this worker's device {uuid}; the update has handles for {', '.join(handles)}")
    return handles[uuid]
