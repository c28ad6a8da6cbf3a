"""What a weight update carries, per transport: the ``init_info`` and ``update_info`` bodies as typed
models, checked field by field. The front checks every body with these before any engine touches a
weight; the engines' receivers parse with the same models; the trainers build what they describe.
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import json
import math
import os
import re
import secrets
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator
from typing_extensions import Self

from ..wire import NonEmptyStr, VersionLabel, WireModel

# The dtypes a pushed tensor may have, by the name vLLM's ``dtype_names`` use, with their sizes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}  # fmt: skip
FLOATING = frozenset(n for n in DTYPE_SIZES if n.startswith(("float", "bfloat")))

Dim = Annotated[int, Field(ge=0, strict=True)]
# vLLM's default packed buffer (its packed_tensor module): 1 GiB.
DEFAULT_BUFFER_SIZE_BYTES = 1024**3


def _known_dtype(name: str) -> str:
    if name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_SIZES)}")
    return name


DtypeName = Annotated[str, AfterValidator(_known_dtype)]


# The fields of an update_info that say something per tensor: a layout (``TensorLayouts``) is these, given
# once, then named by its id.
LAYOUT_FIELDS = ("names", "dtype_names", "shapes", "offsets", "tensor_sizes")
LayoutId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


def layout_id(update_info: dict) -> str:
    """The id of the layout ``update_info``'s per-tensor fields make: a digest of them, so that a
    trainer and a server name the same layout alike without agreeing on anything else."""
    fields = {key: update_info[key] for key in LAYOUT_FIELDS if key in update_info}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


class UnknownLayout(LookupError):
    """An update_info names a layout this side was never given (or has let go of)."""


class TensorLayouts:
    """The layouts given in full so far, by id, the most recently used kept: a push then names its
    layout alone, and nothing per tensor travels (a trainer told it is unknown sends it in full again)."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._by_id: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def __contains__(self, layout: str) -> bool:
        return layout in self._by_id

    def expand(self, update_info: dict) -> dict:
        """``update_info`` with its per-tensor fields, where it names a layout without them."""
        layout = update_info.get("layout")
        if not isinstance(layout, str) or "names" in update_info:
            return update_info  # none named, or given in full (checked as it parses)
        fields = self._by_id.get(layout)
        if fields is None:
            raise UnknownLayout(
                f"update_info.layout {layout[:40]!r} is not one this side was given: send the update_info in full"
                " (its names, dtype_names, shapes) with its layout, as the push that plans it"
            )
        self._by_id.move_to_end(layout)
        return {**update_info, **fields}

    def given(self, meta: UpdateMetadata) -> None:
        """Keep the layout of ``meta``, if it has one."""
        if meta.layout is None or meta.layout in self._by_id:
            return
        self._by_id[meta.layout] = layout_fields(meta)
        while len(self._by_id) > self.keep:
            self._by_id.popitem(last=False)


def layout_fields(meta: UpdateMetadata) -> dict:
    """The per-tensor fields of a parsed update_info: its layout."""
    return {key: getattr(meta, key) for key in LAYOUT_FIELDS if getattr(meta, key, None) is not None}


def without_layout(update_info: dict) -> dict:
    """``update_info`` naming its layout, without the per-tensor fields the layout holds."""
    return {key: value for key, value in update_info.items() if key not in LAYOUT_FIELDS}


class UpdateMetadata(WireModel):
    """vLLM's ``update_info`` core: which tensors a transfer carries, in order; and skyinfer's
    ``layout``, the id of these per-tensor fields (``layout_id``), by which later updates of the
    same tensors may name them alone."""

    names: Annotated[list[str], Field(min_length=1)]
    dtype_names: list[DtypeName]
    shapes: list[list[Dim]]
    layout: LayoutId | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info lists differ in length: {len(self.names)} names, {len(self.dtype_names)} dtype_names,"
                f" {len(self.shapes)} shapes"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("update_info names a tensor twice")
        if self.layout is not None and layout_id(layout_fields(self)) != self.layout:
            raise ValueError(
                "update_info.layout is not the id of its per-tensor fields (skyinfer.transfer.protocol.layout_id)"
            )
        return self

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * DTYPE_SIZES[self.dtype_names[i]]

    def total_bytes(self) -> int:
        return sum(self.nbytes(i) for i in range(len(self.names)))

    def elements(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


# How long a trainer may be silent during an update before the server abandons it (and, for
# a group, how long its collectives may take).
SilenceLimit = Annotated[float, Field(gt=0, le=3600)]


# -- a process group (gloo, nccl) ---------------------------------------------------


class GroupInitInfo(WireModel):
    """The trainer's side of the rendezvous: where rank 0 listens (or NCCL's own unique id, for
    a torch-free trainer), and the group's size."""

    master_address: NonEmptyStr | None = None
    master_port: Annotated[int, Field(ge=1, le=65535, strict=True)] | None = None
    nccl_unique_id_b64: NonEmptyStr | None = None
    world_size: Annotated[int, Field(description="1 + GET /get_world_size for a single trainer")]
    # Both checked against this server's workers by the rank layout.
    rank_offset: int = 1
    # Bounds the rendezvous and every later collective (the server's --weight-transfer-timeout if absent).
    timeout_s: SilenceLimit | None = None
    # Packing many tensors into few broadcasts, by vLLM's rule (transfer/packing.py).
    packed: bool = False
    packed_buffer_size_bytes: Annotated[int, Field(ge=1, strict=True)] = DEFAULT_BUFFER_SIZE_BYTES
    # Accepted as vLLM's NCCL trainer sends it; the receivers take one buffer at a time.
    packed_num_buffers: Annotated[int, Field(ge=1, strict=True)] = 2

    @model_validator(mode="after")
    def _one_rendezvous(self) -> Self:
        by_store = self.master_address is not None or self.master_port is not None
        if by_store == (self.nccl_unique_id_b64 is not None):
            raise ValueError(
                "init_info needs master_address and master_port (a TCP rendezvous), or nccl_unique_id_b64 (NCCL's"
                " own, for a torch-free trainer), not both and not neither"
            )
        if by_store and (self.master_address is None or self.master_port is None):
            raise ValueError("init_info needs both master_address and master_port")
        return self


def sparse_nbytes(count: int, itemsize: int) -> int:
    """A delta's sparse piece: ``count`` int32 positions, then ``count`` values of ``itemsize``
    bytes, each part padded to 8 bytes, so that the values and whatever is packed after the piece
    start aligned (after an int8 tensor's odd count of values, a bf16 tensor could not be viewed)."""
    return _padded(4 * count) + _padded(count * itemsize)


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class DeltaInfo(WireModel):
    """A push that carries only what changed since ``base_version`` (transfer/delta.py): per tensor,
    0 (unchanged, nothing sent), the count of changed elements (their int32 flat positions, then
    their values, in one piece), or -1 (sent whole)."""

    base_version: VersionLabel
    changed: list[Annotated[int, Field(ge=-1, strict=True)]]

    def sent_bytes(self, meta: UpdateMetadata) -> int:
        """The bytes the delta moves (``delta.sparse_nbytes`` for each sparse piece)."""
        return sum(
            meta.nbytes(i) if count == -1 else sparse_nbytes(count, DTYPE_SIZES[meta.dtype_names[i]]) if count else 0
            for i, count in enumerate(self.changed)
        )


class GroupUpdateInfo(UpdateMetadata):
    # None: as agreed at init.
    packed: bool | None = None
    delta: DeltaInfo | None = None
    # The trainer sends deltas on this push later: a worker whose layers cannot be read back as
    # loaded (processed after loading: experts, quantized) keeps a copy of its tensors to apply
    # them on (transfer/delta.py ``KeptBase``). Without it, such a worker keeps nothing.
    keep_for_deltas: bool = False

    @model_validator(mode="after")
    def _delta_fits(self) -> Self:
        if self.delta is None:
            return self
        if self.packed is False:
            raise ValueError("a delta push is packed: packed false and a delta")
        if len(self.delta.changed) != len(self.names):
            raise ValueError(
                f"update_info.delta.changed has {len(self.delta.changed)} counts for {len(self.names)} tensors"
            )
        for i, count in enumerate(self.delta.changed):
            elements = math.prod(self.shapes[i])
            if count > min(elements, 2**31 - 1):
                raise ValueError(
                    f"update_info.delta.changed says {count} elements of {self.names[i]!r} changed; it has {elements}"
                    " (a tensor of 2**31 elements or more is sent whole)"
                )
        return self


# -- shared memory (colocated, CPU) ----------------------------------------------------

SEGMENT_DIR = "/dev/shm"
# skyinfer-<server token>-<segment id>: the server's token is handed out at init, so that the
# server finds (and removes) every segment its trainers made, and nothing else.
_SEGMENT_NAME = re.compile(r"^skyinfer-[0-9a-f]{8}-[0-9a-f]{32}$")
# What a segment's bytes are aligned to: any dtype's size, and a cache line.
SEGMENT_ALIGNMENT = 64


def new_server_token() -> str:
    return secrets.token_hex(4)


def segment_prefix(server_token: str) -> str:
    return f"skyinfer-{server_token}-"


def segment_path(name: str) -> str:
    return os.path.join(SEGMENT_DIR, name)


def checked_segment_name(name: str) -> str:
    """``name``, if it is a segment name a server hands out; else ValueError (no path, no other file)."""
    if not _SEGMENT_NAME.match(name):
        raise ValueError(
            "a segment name is skyinfer-<server token>-<32 hex digits> (the prefix POST /init_weight_transfer"
            " answers), no path"
        )
    return name


SegmentName = Annotated[str, AfterValidator(checked_segment_name)]


class SharedMemoryInitInfo(WireModel):
    """Nothing for the engines to agree on: they map whatever segment an update names."""

    timeout_s: SilenceLimit | None = None


class SharedMemoryUpdateInfo(UpdateMetadata):
    """Tensors laid out in one POSIX shared-memory segment: each at its byte offset, C-contiguous."""

    segment: SegmentName
    offsets: list[Dim]
    # The trainer writes its next pushes into the same segment: the server leaves it in place after
    # a push that finished (transfer/shm.py says when it goes).
    reuse: bool = False

    @model_validator(mode="after")
    def _laid_out(self) -> Self:
        if len(self.offsets) != len(self.names):
            raise ValueError(f"update_info has {len(self.offsets)} offsets for {len(self.names)} tensors")
        for i, offset in enumerate(self.offsets):
            if offset % DTYPE_SIZES[self.dtype_names[i]]:
                raise ValueError(f"offset {offset} of {self.names[i]!r} is not aligned to its dtype's size")
        return self

    def end(self) -> int:
        """The segment size the layout needs."""
        return max(offset + self.nbytes(i) for i, offset in enumerate(self.offsets))

    def check_segment(self, prefix: str) -> None:
        """Raise ValueError unless the named segment is this server's and holds every tensor."""
        if not self.segment.startswith(prefix):
            raise ValueError(f"segment {self.segment!r} is not this server's: its names begin {prefix!r}")
        try:
            size = os.stat(segment_path(self.segment)).st_size
        except FileNotFoundError:
            raise ValueError(f"segment {self.segment!r} does not exist (already removed, or never written)") from None
        if self.end() > size:
            raise ValueError(
                f"the tensors end at byte {self.end()}, past the end of segment {self.segment!r} ({size} bytes)"
            )


def remove_segments(prefix: str, keep: str | None = None) -> list[str]:
    """Remove every segment whose name begins ``prefix`` (but ``keep``); the names removed."""
    removed = []
    try:
        names = os.listdir(SEGMENT_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(prefix) and name != keep:
            try:
                os.unlink(segment_path(name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


# -- CUDA IPC (colocated, GPU) -----------------------------------------------------------

# torch's rebuild_cuda_tensor takes classes and a dtype; the JSON form names them from these.
TENSOR_CLASSES = ("Tensor", "Parameter")
STORAGE_CLASSES = ("TypedStorage", "UntypedStorage")
# A device's UUID as torch prints it, with or without NVML's GPU-/MIG- prefix.
_DEVICE_UUID = re.compile(
    r"^(?:(?:GPU|MIG)-)?[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)
# CUDA's IPC handles are 64 bytes; torch's ref-counter handle is a shared-memory file name.
_MAX_HANDLE_BYTES = 512


def _base64_bytes(value: str) -> str:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not standard base64") from None
    if not 0 < len(raw) <= _MAX_HANDLE_BYTES:
        raise ValueError(f"decodes to {len(raw)} bytes; a handle has 1 to {_MAX_HANDLE_BYTES}")
    return value


Base64Handle = Annotated[str, AfterValidator(_base64_bytes)]


def _device_uuid(value: str) -> str:
    if not _DEVICE_UUID.match(value):
        raise ValueError(f"{value[:60]!r} is not a GPU UUID")
    return value


DeviceUuid = Annotated[str, AfterValidator(_device_uuid)]
# What stands for a GPU's UUID where the handles are to host memory (a CPU's stand-in for CUDA IPC).
HOST_MEMORY_UUID = "GPU-00000000-0000-0000-0000-000000000000"


class IpcHandle(WireModel):
    """The arguments of torch's ``rebuild_cuda_tensor``, as JSON: what ``reduce_tensor`` gives for
    one CUDA tensor, bytes in base64 and classes by name."""

    tensor_class: Literal[TENSOR_CLASSES]  # type: ignore[valid-type]
    size: Annotated[list[Dim], Field(max_length=16)]
    stride: Annotated[list[Dim], Field(max_length=16)]
    offset: Dim
    storage_class: Literal[STORAGE_CLASSES]  # type: ignore[valid-type]
    dtype: DtypeName
    device: Annotated[int, Field(ge=0, lt=1024, strict=True)]
    storage_handle: Base64Handle
    storage_size_bytes: Dim
    storage_offset_bytes: Dim
    requires_grad: bool = False
    ref_counter_handle: Base64Handle
    ref_counter_offset: Dim
    event_handle: Base64Handle | None = None
    event_sync_required: bool = False

    @model_validator(mode="after")
    def _fits_its_storage(self) -> Self:
        if len(self.size) != len(self.stride):
            raise ValueError(f"size {self.size} and stride {self.stride} differ in length")
        if self.event_sync_required and self.event_handle is None:
            raise ValueError("event_sync_required without an event_handle")
        last = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride) if n)
        if math.prod(self.size) and (last + 1) * DTYPE_SIZES[self.dtype] > self.storage_size_bytes:
            raise ValueError(f"the tensor reaches past its storage ({self.storage_size_bytes} bytes)")
        return self


# One tensor's handles: for each GPU (by UUID) that holds a copy, the handle to it.
HandlesByDevice = Annotated[dict[DeviceUuid, IpcHandle], Field(min_length=1)]


class IpcInitInfo(WireModel):
    """vLLM's ipc init_info: no rendezvous, only whether updates come packed (and skyinfer's
    trainer's silence limit, which only the front reads)."""

    packed: bool = False
    timeout_s: SilenceLimit | None = None


class IpcUpdateInfo(UpdateMetadata):
    """vLLM's ipc update_info with skyinfer's JSON handles (``ipc_handles``: per tensor, or one for
    a packed buffer), or vLLM's pickled ones (``ipc_handles_pickled``), which only a server started
    with --allow-pickled-ipc takes."""

    ipc_handles: list[HandlesByDevice] | HandlesByDevice | None = None
    ipc_handles_pickled: NonEmptyStr | None = None
    # Packed: each tensor's bytes within the one buffer.
    tensor_sizes: list[Dim] | None = None
    # Packed: the trainer writes its next pushes into the same buffer, exported once: each worker
    # keeps it open from one push to the next (until an update names another, an init or the
    # transfer's shutdown), and the server leaves a CPU's stand-in segment for it in place after a
    # push that finished.
    reuse: bool = False

    @model_validator(mode="after")
    def _handles(self) -> Self:
        if (self.ipc_handles is None) == (self.ipc_handles_pickled is None):
            raise ValueError("update_info needs ipc_handles (JSON) or ipc_handles_pickled, exactly one")
        if isinstance(self.ipc_handles, list):
            if len(self.ipc_handles) != len(self.names):
                raise ValueError(f"update_info has {len(self.ipc_handles)} ipc_handles for {len(self.names)} tensors")
            for i, by_device in enumerate(self.ipc_handles):
                for handle in by_device.values():
                    if handle.size != self.shapes[i] or handle.dtype != self.dtype_names[i]:
                        raise ValueError(
                            f"the handle of {self.names[i]!r} is {handle.dtype} {handle.size}; update_info says"
                            f" {self.dtype_names[i]} {self.shapes[i]}"
                        )
        elif isinstance(self.ipc_handles, dict):
            if self.tensor_sizes is None or len(self.tensor_sizes) != len(self.names):
                raise ValueError("a packed update (one handle for the buffer) needs tensor_sizes, one per tensor")
            if any(self.tensor_sizes[i] != self.nbytes(i) for i in range(len(self.names))):
                raise ValueError("tensor_sizes disagree with the tensors' dtypes and shapes")
            for handle in self.ipc_handles.values():
                if handle.storage_size_bytes < sum(self.tensor_sizes):
                    raise ValueError("the packed buffer is smaller than the tensors it carries")
        elif self.reuse:
            raise ValueError("reuse names a packed buffer: one handle for the buffer, and tensor_sizes")
        return self

    def host_segment(self) -> str | None:
        """The shared-memory segment a CPU's stand-in handle of a packed buffer names, if any."""
        if not isinstance(self.ipc_handles, dict) or HOST_MEMORY_UUID not in self.ipc_handles:
            return None
        return base64.b64decode(self.ipc_handles[HOST_MEMORY_UUID].storage_handle).decode()

    @property
    def pickled(self) -> bool:
        return self.ipc_handles_pickled is not None
