"""What the engines' receivers share: checkpoint-format tensors loaded through vLLM's layerwise reload.

A receiver is a mixin of vLLM's weight-transfer backend interface: engine/backends.py mixes it
with vLLM's ``WeightTransferEngine`` when it registers the backend, so that the transport modules,
which trainers import too, never import vLLM.
"""

from __future__ import annotations

import torch


class LayerwiseReceiver:
    """Start and finish an update as vLLM's own checkpoint-format backends do."""

    supports_draft_weight_update = False
    # How the last update_weights went: None, or the exception it raised (kept for the engine to
    # ask for, since raising through vLLM's executor on a worker of rank 0 leaves the others'
    # answers queued for the engine's next call: engine/worker_calls.py).
    receive_failure: BaseException | None = None

    def start_weight_update(self) -> None:
        from ..vllm_api import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has
        # nothing to do (and no accelerator to ask) on CPU.
        self.receive_failure = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as exc:
            self.receive_failure = exc

    def finish_weight_update(self) -> None:
        finish_layerwise_reload(self.model, self.model_config)


def finish_layerwise_reload(model: torch.nn.Module, model_config) -> None:
    """vLLM's finalize of a layerwise reload (layers that received nothing get their old tensors
    back), plus the CPU fix for tied embeddings: the CPU lm_head keeps a packed copy of the old
    embedding after a reload; re-running its post-load step repacks it."""
    from ..vllm_api import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    hf_config = getattr(model_config, "hf_config", None)
    lm_head = getattr(model, "lm_head", None)
    if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None:
        return
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(lm_head)
