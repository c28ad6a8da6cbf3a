"""Weights over NCCL, for engines on GPUs of their own: the engines' side of vLLM's ``nccl`` wire.

The trainer's side is vLLM's own ``NCCLTrainerWeightTransferEngine`` (packed or not), unchanged:
it opens rank 0 of a ``StatelessProcessGroup`` at ``master_address:master_port`` and NCCL's
communicator over it, then broadcasts each tensor, or each chunk as vLLM's ``packed_tensor`` lays
them out. The engines join the same way (or from a torch-free trainer's ``nccl_unique_id_b64``) and
receive as every process-group transport does (``collective``): a failure kept for the engine to
ask for, the rest of a layer a push filled in part kept, CPU mixture-of-experts kernels repacked.

The device primitive is NCCL's communicator (vLLM's ``PyNcclCommunicator``). On a CPU, where NCCL
does not run, ``GlooCommunicator`` takes its place, with the same constructor and calls over the
same rendezvous: a CPU server started with ``--weight-transport nccl`` (the test suite's) runs
every other line of this path as a GPU does, for a trainer whose communicator (and CUDA streams)
are swapped the same way.
"""

from __future__ import annotations

import base64
from datetime import timedelta

import torch
import torch.distributed as dist

from .collective import Communicator, GroupReceiver
from .protocol import GroupInitInfo

__all__ = ["GlooCommunicator", "NcclReceiver"]


class GlooCommunicator:
    """NCCL's communicator stood in by a gloo group: ``PyNcclCommunicator(group, device)``'s
    constructor and calls, over the ``StatelessProcessGroup`` it is given (its store, rank and
    size; its store's timeout bounds every broadcast). Every rank must use it: it speaks gloo."""

    def __init__(self, group, device=None, library_path: str | None = None) -> None:
        self.rank, self.world_size = group.rank, group.world_size
        store = dist.PrefixStore("skyinfer-nccl-stand-in", group.store)
        timeout = getattr(group.store, "timeout", None) or timedelta(minutes=30)
        self._group = dist.ProcessGroupGloo(store, group.rank, group.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._group.broadcast([tensor], options).wait()

    def destroy(self) -> None:
        self._group = None


# The device primitive on a GPU: NCCL's communicator, as vLLM builds it for its own receivers.


def _nccl_communicator(group, device: torch.device) -> Communicator:
    from ..vllm_api import PyNcclCommunicator, unpinned_nccl_env

    with unpinned_nccl_env():
        return PyNcclCommunicator(group, device=device)


def _nccl_communicator_from_unique_id(unique_id: bytes, rank: int, world_size: int, device) -> Communicator:
    from ..vllm_api import PyNcclCommunicator, unpinned_nccl_env

    with unpinned_nccl_env():
        return PyNcclCommunicator.from_unique_id_bytes(unique_id, rank=rank, world_size=world_size, device=device)


class NcclReceiver(GroupReceiver):
    """vLLM's NCCL rendezvous and wire, into skyinfer's receiver."""

    def _open(self, info: GroupInitInfo, rank: int) -> Communicator:
        from ..vllm_api import StatelessProcessGroup

        on_gpu = self.device.type == "cuda"
        if info.nccl_unique_id_b64 is not None:
            if not on_gpu:
                raise ValueError("nccl_unique_id_b64 needs NCCL itself: on CPU, join by master_address and master_port")
            unique_id = base64.b64decode(info.nccl_unique_id_b64)
            return _nccl_communicator_from_unique_id(unique_id, rank, info.world_size, self.device)
        group = StatelessProcessGroup.create(
            info.master_address, info.master_port, rank, info.world_size, store_timeout=int(info.timeout_s)
        )
        return _nccl_communicator(group, self.device) if on_gpu else GlooCommunicator(group, self.device)
