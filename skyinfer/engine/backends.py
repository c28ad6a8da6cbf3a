"""skyinfer's weight-transfer backends as vLLM backends: each transport's receiver (``transfer/``)
mixed with the vLLM class it extends, and registered with vLLM's ``WeightTransferEngineFactory`` on
import (the worker extension imports this module in every worker, before the model loads)."""

from __future__ import annotations

from ..transfer import GLOO, IPC, NCCL, SHM
from ..transfer.gloo import GlooReceiver
from ..transfer.ipc import IpcReceiver
from ..transfer.nccl import NcclReceiver
from ..transfer.shm import SharedMemoryReceiver
from ..vllm_api import WeightTransferEngine, WeightTransferEngineFactory

__all__ = ["GlooBackend", "IpcBackend", "NcclBackend", "SharedMemoryBackend"]


class GlooBackend(GlooReceiver, WeightTransferEngine):
    """``skyinfer_gloo``: a gloo group with the trainer (separate devices, CPU)."""


class NcclBackend(NcclReceiver, WeightTransferEngine):
    """``skyinfer_nccl``: vLLM's NCCL rendezvous and wire (separate devices, GPU; on CPU over gloo)."""


class SharedMemoryBackend(SharedMemoryReceiver, WeightTransferEngine):
    """``skyinfer_shm``: the trainer's shared-memory segments, mapped (colocated, CPU)."""


class IpcBackend(IpcReceiver, WeightTransferEngine):
    """``skyinfer_ipc``: CUDA IPC handles, skyinfer's JSON ones or vLLM's pickled ones (colocated, GPU;
    on CPU, torch's shared memory in CUDA's place)."""


# Every skyinfer backend (transfer.SKYINFER_BACKENDS), as vLLM's factory.py registers its own.

WeightTransferEngineFactory.register_engine(GLOO.backend, GlooBackend)

WeightTransferEngineFactory.register_engine(NCCL.backend, NcclBackend)

WeightTransferEngineFactory.register_engine(SHM.backend, SharedMemoryBackend)

WeightTransferEngineFactory.register_engine(IPC.backend, IpcBackend)
