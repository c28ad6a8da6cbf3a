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
    # How the last update_weights or finish went: None, or the exception it raised (kept for the
    # engine to ask for, since raising through vLLM's executor on a worker of rank 0 leaves the
    # others' answers queued for the engine's next call: engine/worker_calls.py).
    update_failure: BaseException | None = None

    # The CPU mixture-of-experts layers' kernels, forgotten for the update (``forget_cpu_moe_kernels``).
    _moe_kernels: dict | None = None

    def start_weight_update(self) -> None:
        from ..vllm_api import initialize_layerwise_reload

        self._moe_kernels = forget_cpu_moe_kernels(self.model)
        try:
            initialize_layerwise_reload(self.model)
        except BaseException:
            restore_cpu_moe_kernels(self._moe_kernels)
            raise

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has
        # nothing to do (and no accelerator to ask) on CPU.
        self.update_failure = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as exc:
            self.update_failure = exc

    def finish_weight_update(self) -> None:
        self.update_failure = None
        try:
            finish_layerwise_reload(self.model, self.model_config)
        except PartOfALayerRefused as exc:
            # Kept: the layers it names kept their weights whole, and vLLM's session ends as after
            # any finish (an update the front aborted ends here too: its engines are stale anyway).
            self.update_failure = exc
        finally:
            restore_cpu_moe_kernels(self._moe_kernels or {})
            self._moe_kernels = None


class PartOfALayerRefused(ValueError):
    """A push carried part of a layer whose rest cannot be read back from what it serves."""


def finish_layerwise_reload(model: torch.nn.Module, model_config) -> None:
    """vLLM's finalize of a layerwise reload (layers that received nothing get their old tensors
    back; layers that received part of their weights are first given the rest as served, or refused),
    plus the CPU fix for tied embeddings: the CPU lm_head keeps a packed copy of the old embedding
    after a reload; re-running its post-load step repacks it."""
    from ..vllm_api import finalize_layerwise_reload

    refused = keep_what_the_push_left_out(model)
    finalize_layerwise_reload(model, model_config)
    hf_config = getattr(model_config, "hf_config", None)
    lm_head = getattr(model, "lm_head", None)
    if getattr(hf_config, "tie_word_embeddings", False) and lm_head is not None:
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)
    if refused:
        raise PartOfALayerRefused(
            f"the push carried part of the weights of {', '.join(refused)}, whose rest cannot be read"
            " back from what they serve (quantized or packed): they serve their old weights; push all of them"
        )


def keep_what_the_push_left_out(model: torch.nn.Module) -> list[str]:
    """Give each layer a push filled in part the rest of its weights as it serves them; the layers
    that cannot be given them, which keep their old weights whole instead.

    vLLM reloads a layer whole: the layer is processed once every element of it came, and at the
    finish a layer that got only part of its weights (q of a fused q/k/v projection, up of gate/up)
    is processed from fresh memory, the parts the push left out uninitialized: the engine then serves
    NaN without an error (vLLM 0.32; a layer with padding its checkpoint never fills, a vocabulary's,
    takes the same way). Materialized from its served tensors first, the loads the finish replays
    over it leave the rest as it was. Only a layer that serves its weights as they were loaded can
    be given them back; any other (a quantized layer, packed experts) is left as if the push sent
    it nothing, so the finish puts its served tensors back, and the caller reports it."""
    from ..vllm_api import get_layerwise_info, is_deferred_attention_layer, materialize_layer

    refused = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if info.kernel_tensors is None or not info.can_load() or is_deferred_attention_layer(layer):
            continue  # nothing served to keep (a first load), or no reload open, or vLLM's own finish
        if not 0 < info.load_numel < info.load_numel_total:
            continue
        if not _serves_as_loaded(layer, info):
            refused.append(name)
            info.load_numel, info.loaded_weights = 0, []
            continue
        params, buffers = info.kernel_tensors
        served = params | buffers
        materialize_layer(layer, info)
        with torch.no_grad():
            for tensor_name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
                if tensor_name in served and not tensor.is_meta and tensor is not served[tensor_name]:
                    tensor.copy_(served[tensor_name])
    return refused


def _serves_as_loaded(layer: torch.nn.Module, info) -> bool:
    """Whether the layer computes with its weights in the layout they were loaded in (an unquantized
    linear layer or embedding), so that what it serves can seed a partial reload of it."""
    from ..vllm_api import UnquantizedEmbeddingMethod, UnquantizedLinearMethod

    if not isinstance(getattr(layer, "quant_method", None), (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        return False
    params, buffers = info.kernel_tensors
    created = {**info.restore_metadata[0], **info.restore_metadata[1]}
    return all(
        name not in created or (created[name].shape == t.shape and created[name].dtype == t.dtype)
        for name, t in (params | buffers).items()
    )


def unquantized_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's unquantized mixture-of-experts layers."""
    from ..vllm_api import UnquantizedFusedMoEMethod

    return [
        layer
        for layer in model.modules()
        if isinstance(getattr(layer, "quant_method", None), UnquantizedFusedMoEMethod)
    ]


def cpu_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's unquantized mixture-of-experts layers whose experts live on CPU."""
    return [layer for layer in unquantized_moe_layers(model) if layer.w13_weight.device.type == "cpu"]


def forget_cpu_moe_kernels(model: torch.nn.Module) -> dict[torch.nn.Module, tuple]:
    """Make each CPU mixture-of-experts layer look unprocessed to the reload about to start; each
    layer's kernel and its config, to give back to a layer the reload leaves as it was.

    vLLM's CPU MoE kernel computes with the experts padded to its alignment and packed into its
    grouped-GEMM layout when the layer is processed after loading. On a reload, vLLM's unquantized MoE
    method takes a kernel it already built as the sign of a weight update: it copies the new weights
    into the old tensors unpacked and skips the padding and packing, and the engine serves garbage
    without an error (vLLM 0.32; GPU stacks met the same class of bug, vLLM #42821). With its kernel
    forgotten, the layer is processed as at start-up: padded, packed, its kernel built again; the
    reload then copies the result into the tensors the engine computes with. GPU layers keep theirs:
    their copy keeps the addresses CUDA graphs hold, and their unquantized kernels pack nothing."""
    forgotten = {}
    for layer in cpu_moe_layers(model):
        method = layer.quant_method
        if method.moe_kernel is not None:
            forgotten[layer] = (method.moe_kernel, method.moe_quant_config)
            method.moe_kernel = None
    return forgotten


def restore_cpu_moe_kernels(forgotten: dict[torch.nn.Module, tuple]) -> None:
    """A layer the reload did not process again (no weight of it came) has its old tensors back:
    its old kernel goes with them."""
    for layer, (kernel, config) in forgotten.items():
        if layer.quant_method.moe_kernel is None:
            layer.quant_method.moe_kernel, layer.quant_method.moe_quant_config = kernel, config
