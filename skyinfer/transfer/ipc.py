"""Weights through CUDA IPC, for a trainer colocated with the engines on GPUs: both sides.

NCCL cannot put two ranks of one group on one GPU, so a trainer sharing its GPUs with the
engines hands them its tensors instead: for each tensor, the arguments of torch's
``rebuild_cuda_tensor`` (what ``reduce_tensor`` gives), from which each engine worker maps the
trainer's memory on its own GPU and loads it through vLLM's ``ipc`` backend. vLLM's own HTTP
client pickles those arguments (``ipc_handles_pickled``); skyinfer carries them as JSON it
defines (``protocol.IpcHandle``: handle bytes in base64, classes and dtype by name), checked
field by field, so no pickle crosses the wire. A server started with ``--allow-pickled-ipc``
also takes vLLM's pickled body, as vLLM does with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

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
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..client import Client, SkyinferError
from .protocol import IpcHandle, IpcInitInfo, IpcUpdateInfo
from .pushing import NamedTensors, OneCall, Trainer, update_weights_call
from .receiving import LayerwiseReceiver

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


def _device_uuid() -> str:
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


class IPCTrainer(Trainer):
    """A trainer on the same GPUs as a colocated skyinfer server (``--colocate``): pushes from its
    own GPU memory. With torch.distributed initialized, call ``init`` and ``push`` on every rank of
    ``group`` (torch's default group unless given): they return on every rank, or raise on every
    rank (a refusal of the server as ``SkyinferError``, the same on every rank)."""

    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        timeout_s: float = 120.0,
        client: Client | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client)
        self._ranks = Ranks(group)
        # The engines map this process's memory: the tensors must outlive the update's finish.
        self._keep: list[torch.Tensor] = []
        # Every rank's handles per tensor, gathered as the tensors are prepared.
        self._handles: list[dict[str, dict]] = []

    def init(self) -> None:
        """Tell the engines a trainer pushes through CUDA IPC; on every rank, which all return or all raise."""
        self._ranks.agree(self._init_engines)

    def _init_engines(self) -> None:
        self.client.init_weight_transfer_engine({"packed": False, "timeout_s": self.timeout_s})

    def _pushed(self) -> None:
        # Every rank's tensors and handles, held for the engines while they copied them.
        self._keep, self._handles = [], []
        self._release_exported()

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        tensors: list[tuple[str, torch.Tensor]] = []

        def export() -> list[dict[str, dict]]:
            tensors.extend((name, self._on_device(t)) for name, t in named_tensors)
            self._keep.extend(t for _, t in tensors)
            return self._export_handles(tensors)

        self._handles = self._ranks.gather(export)
        return tensors

    def _in_group(self, send: Callable[[], None]) -> None:
        # Rank 0's calls, with the retry of Trainer._in_group (its init makes no collective there):
        # the other ranks learn only the outcome.
        self._ranks.agree(functools.partial(super()._in_group, send))

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        # Gathered when the tensors were prepared, so that a push sent again carries the same ones.
        update_weights_call(self._calls, {**metadata, "ipc_handles": self._handles}, one_call)

    # The CUDA steps, apart from the ranks' choreography (a test runs that on CPU with stand-ins).

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(torch.device("cuda", torch.cuda.current_device())).contiguous()

    def _export_handles(self, tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, dict]]:
        """One ``{this GPU's uuid: handle}`` per tensor."""
        from torch.multiprocessing.reductions import reduce_tensor

        here = _device_uuid()
        return [{here: encode_handle(reduce_tensor(t)[1])} for _, t in tensors]

    def _release_exported(self) -> None:
        torch.cuda.ipc_collect()


# -- the engines' side ----------------------------------------------------------------


class IpcReceiver(LayerwiseReceiver):
    """vLLM's ``ipc`` backend taking skyinfer's JSON handles (or, where the server allows it, vLLM's
    pickled ones); mixed with vLLM's ``IPCWeightTransferEngine`` in engine/backends.py."""

    init_info_cls = IpcInitInfo
    update_info_cls = IpcUpdateInfo

    def receive_weights(self, update_info: IpcUpdateInfo) -> None:
        from ..vllm_api import IPCWeightTransferUpdateInfo

        fields = {"names": update_info.names, "dtype_names": update_info.dtype_names, "shapes": update_info.shapes}
        if update_info.pickled:
            # vLLM unpickles it, and only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (--allow-pickled-ipc).
            vllm_info = IPCWeightTransferUpdateInfo(
                **fields, ipc_handles_pickled=update_info.ipc_handles_pickled, tensor_sizes=update_info.tensor_sizes
            )
        elif isinstance(update_info.ipc_handles, dict):
            handles = {uuid: decode_handle(h) for uuid, h in update_info.ipc_handles.items()}
            vllm_info = IPCWeightTransferUpdateInfo(
                **fields, ipc_handles=handles, tensor_sizes=update_info.tensor_sizes
            )
        else:
            handles = [{uuid: decode_handle(h) for uuid, h in per.items()} for per in update_info.ipc_handles or []]
            vllm_info = IPCWeightTransferUpdateInfo(**fields, ipc_handles=handles)
        super().receive_weights(vllm_info)
