"""skyinfer's vLLM worker extension (``--worker-extension-cls``).

vLLM imports this module in every worker process before the model loads,
which is the supported moment to register the gloo weight-transfer backend;
the class adds the one worker call the front needs beyond vLLM's own.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from . import GLOO_BACKEND
from .gloo_transfer import GlooWeightTransferEngine

WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)


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
