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
exports the handles of its own GPU's copy, rank 0 gathers them and sends one update carrying all
of them; each engine worker takes the handle of its GPU::

    trainer = IPCTrainer("http://127.0.0.1:8000")   # a server started with --colocate, on GPUs
    trainer.init()
    trainer.push(model.state_dict().items(), version="step-17")
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import torch

from ..client import Client
from .protocol import IpcHandle, IpcInitInfo, IpcUpdateInfo
from .pushing import NamedTensors, Trainer

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


# -- the trainer's side ---------------------------------------------------------------


def _device_uuid() -> str:
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _gathered(handles: list[dict[str, dict]]) -> list[dict[str, dict]]:
    """Every rank's handles merged per tensor (on every rank), when a multi-rank trainer pushes."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return handles
    gathered: list[list[dict[str, dict]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, handles)
    return [{uuid: h for rank in gathered for uuid, h in rank[i].items()} for i in range(len(handles))]


def _is_sender() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


class IPCTrainer(Trainer):
    """A trainer on the same GPUs as a colocated skyinfer server (``--colocate``): pushes from its
    own GPU memory. With torch.distributed initialized, call ``init`` and ``push`` on every rank."""

    def __init__(
        self, base_url: str, *, admin_key: str | None = None, timeout_s: float = 120.0, client: Client | None = None
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client)

    def init(self) -> None:
        if _is_sender():
            self.client.init_weight_transfer_engine({"packed": False, "timeout_s": self.timeout_s})

    def push(self, named_tensors: NamedTensors, version: str, one_call: bool = False, verify: bool = False) -> None:
        # The engines map this process's memory: the tensors must outlive the update's finish.
        self._keep: list[torch.Tensor] = []
        try:
            if _is_sender():
                super().push(named_tensors, version, one_call, verify)
            else:
                self._send(self._prepare(named_tensors), {}, None)
        finally:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
            self._keep = []
            torch.cuda.ipc_collect()

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        device = torch.device("cuda", torch.cuda.current_device())
        tensors = [(name, t.detach().to(device).contiguous()) for name, t in named_tensors]
        self._keep.extend(t for _, t in tensors)
        return tensors

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call_version: str | None) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        here = _device_uuid()
        handles = _gathered([{here: encode_handle(reduce_tensor(t)[1])} for _, t in tensors])
        if _is_sender():
            self._calls.update_weights({**metadata, "ipc_handles": handles}, one_call_version)


# -- the engines' side ----------------------------------------------------------------


class IpcReceiver:
    """vLLM's ``ipc`` backend taking skyinfer's JSON handles (or, where the server allows it, vLLM's
    pickled ones); mixed with vLLM's ``IPCWeightTransferEngine`` by the worker extension."""

    init_info_cls = IpcInitInfo
    update_info_cls = IpcUpdateInfo

    def receive_weights(self, update_info: IpcUpdateInfo) -> None:
        from ..engine.vllm_api import IPCWeightTransferUpdateInfo

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
