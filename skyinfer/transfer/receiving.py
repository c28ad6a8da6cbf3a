"""What the engines' receivers share: checkpoint-format tensors loaded into the live model, straight
into its weights where every layer serves them as loaded (``InPlaceLoad``), else through vLLM's
layerwise reload.

A receiver is a mixin of vLLM's weight-transfer backend interface: engine/backends.py mixes it
with vLLM's ``WeightTransferEngine`` when it registers the backend, so that the transport modules,
which trainers import too, never import vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .delta import KeptBase, check_positions
from .packing import TensorMeta
from .plans import ApplyPlans
from .protocol import TensorLayouts, UnknownLayout

# The device primitives of a receive on a thread of its own, on a GPU: the thread's device and the
# stream's end. A CPU has neither: its threads share the one device, its copies end as they return.


def bind_thread(device: torch.device) -> None:
    torch.cuda.set_device(device)  # a new thread's is GPU 0: its work is this worker's


def wait_for(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class LiveReceiver:
    """Start, load and finish an update of the live model.

    A model all of whose layers compute with their weights as loaded (unquantized linear layers and
    embeddings, norms: a dense bf16 model) takes the push's tensors straight into its parameters,
    through its own loaders, as at start-up: one copy per element, no memory allocated; a CPU layer
    a push wrote packs its kernel's copy again (``InPlaceLoad``). Any other (quantized layers, mixture
    of experts, attention layers that derive tensors from their weights) goes through vLLM's
    layerwise reload, as vLLM's own checkpoint-format backends do: each layer reloaded whole into
    fresh memory and processed as at start-up, then copied into the tensors the engine computes with;
    it applies a delta to the copy of the checkpoint's tensors it keeps where its trainer asks
    (delta.py ``KeptBase``), and reloads each layer the delta touched from it."""

    supports_draft_weight_update = False
    # How the last update_weights or finish went: None, or the exception it raised (kept for the
    # engine to ask for, since raising through vLLM's executor on a worker of rank 0 leaves the
    # others' answers queued for the engine's next call: engine/worker_calls.py).
    update_failure: BaseException | None = None

    # The CPU mixture-of-experts layers' kernels, forgotten for the update (``forget_cpu_moe_kernels``).
    _moe_kernels: dict | None = None
    # The update under way when it loads in place; None when it reloads layerwise (or none is open).
    _in_place: InPlaceLoad | None = None
    # How the last finished update was applied, for the front (``skyinfer_update_outcome``).
    last_applied: dict | None = None
    # The live model's apply plans (plans.py), recorded at the first in-place push of each tensor.
    _plans: ApplyPlans | None = None

    # A model that reloads layerwise: the copy of what it took, to apply deltas on (delta.py).
    _kept: KeptBase | None = None
    # Whether the chunk received now is a delta.
    _receiving_delta = False

    # The layouts this worker was given in full (protocol.py): an update may name its own alone.
    _layouts: TensorLayouts | None = None

    def parse_update_info(self, update_dict: dict):
        if self._layouts is None:
            self._layouts = TensorLayouts()
        try:
            info = super().parse_update_info(self._layouts.expand(update_dict))
        except UnknownLayout as exc:
            raise ValueError(str(exc)) from None
        self._layouts.given(info)
        return info

    def start_weight_update(self) -> None:
        self.last_applied = None
        if applies_in_place(self.model):
            if self._plans is None or self._plans.model is not self.model:
                self._plans = ApplyPlans(self.model)
            self._in_place = InPlaceLoad(self.model, self._plans)
            return
        from ..vllm_api import initialize_layerwise_reload

        if self._kept is None or self._kept.model is not self.model:
            self._kept = KeptBase(self.model)
        self._kept.begin()
        self._moe_kernels = forget_cpu_moe_kernels(self.model)
        try:
            initialize_layerwise_reload(self.model)
        except BaseException:
            restore_cpu_moe_kernels(self._moe_kernels)
            self._kept.end(finished=False)
            raise

    def drop_kept(self) -> None:
        """Let go of what is kept open for the trainer's next push (a transport's own): an update was
        aborted, and its trainer may be gone."""

    @property
    def loads_at_once(self) -> bool:
        """Whether the tensors given to ``load`` are copied before it returns (an in-place update
        of the live model): a transport may then hand views of a buffer it reuses. vLLM's layerwise
        reload may replay a layer's loads from what it was given later; so may a target's."""
        return self._in_place is not None and self.model is self._in_place.model

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint-format tensors into the update's target (the live model, or the target a
        staged push or an adapter set); the names of the parameters written."""
        if self.loads_at_once:
            return self._in_place.load(weights)
        kept = self._kept_open()
        if kept is not None and kept.keeping:
            weights = list(weights)
            kept.put(weights, of_delta=self._receiving_delta)
            if self._receiving_delta:
                return set()  # reloaded from the copy at the finish, with the rest of their layers
        return self.model.load_weights(weights)

    def _kept_open(self) -> KeptBase | None:
        """The kept copy of the live model whose update is open, if the update loads into it."""
        kept = self._kept
        return kept if kept is not None and kept.open and kept.model is self.model else None

    def forget_base(self) -> None:
        """The live weights were written outside an update (a peer's import, a staged swap): the
        kept copy is no longer what they hold."""
        if self._kept is not None:
            self._kept.forget()

    def load_delta(self, meta: TensorMeta, positions: torch.Tensor, values: torch.Tensor) -> set[str]:
        """Write a delta of one checkpoint tensor (``values`` at their flat ``positions``) into the
        live model: by the tensor's apply plan, in place, or into the kept copy of a model that
        reloads layerwise (its layer reloaded at the finish); the names of the parameters written
        now. A staged copy or an adapter has nothing to apply it on: ValueError."""
        check_positions(meta, positions)
        if self.loads_at_once:
            return self._in_place.load_delta(meta, positions, values)
        kept = self._kept_open()
        if kept is None:
            raise ValueError("a delta push is applied to the live weights, not to a staged copy or an adapter")
        kept.apply(meta.name, positions, values)
        return set()

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has
        # nothing to do (and no accelerator to ask) on CPU.
        self.update_failure = None
        kept = self._kept_open()
        try:
            info = self.parse_update_info(update_info)
            if kept is not None:
                kept.chunk(getattr(info, "keep_for_deltas", False))
            self._receiving_delta = getattr(info, "delta", None) is not None
            self.receive_weights(info)
        except Exception as exc:
            self.update_failure = exc
            if kept is not None:
                kept.failed()

    def finish_weight_update(self) -> None:
        self.update_failure = None
        in_place, self._in_place = self._in_place, None
        if in_place is not None:
            # Whatever came, as it came: a push that failed part way leaves its engine stale (the
            # front holds it out), its packed kernels matching its parameters.
            self.last_applied = in_place.finish()
            return
        kept, finished = self._kept_open(), False
        reloaded = kept.to_reload() if kept is not None else []
        try:
            try:
                if reloaded:  # the layers a delta touched, whole, from the copy it was applied to
                    self.model.load_weights(reloaded)
            except Exception as exc:  # vLLM's reload still ends, below; the engine is stale
                self.update_failure = exc
            finish_layerwise_reload(self.model, self.model_config)
            finished = self.update_failure is None
        except PartOfALayerRefused as exc:
            # Kept: the layers it names kept their weights whole, and vLLM's session ends as after
            # any finish (an update the front aborted ends here too: its engines are stale anyway).
            self.update_failure = exc
        finally:
            restore_cpu_moe_kernels(self._moe_kernels or {})
            self._moe_kernels = None
            if kept is not None:
                kept.end(finished)
        self.last_applied = {
            "applied": "layerwise reload",
            # Whether a delta can come on what it now serves (the copy it keeps is current).
            "base": kept is not None and kept.current,
            "deltas": kept.deltas if kept is not None else 0,
            "reloaded_from_copy": len(reloaded),
        }


def applies_in_place(model: torch.nn.Module) -> bool:
    """Whether every layer of ``model`` that holds weights computes with them as its loaders write
    them, but for a CPU linear layer's packed kernel (``pack_cpu_gemms``): an unquantized linear
    layer or embedding, or a layer vLLM does not process after loading (a norm). Unquantized
    mixture-of-experts layers (packed and padded on CPU), quantized ones and attention layers that
    derive tensors from their weights (MLA) are processed after loading: their model reloads
    layerwise."""
    from ..vllm_api import UnquantizedEmbeddingMethod, UnquantizedLinearMethod, is_deferred_attention_layer

    for module in model.modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        method = getattr(module, "quant_method", None)
        if method is None:
            if hasattr(module, "process_weights_after_loading"):
                return False
        elif not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return False
        if is_deferred_attention_layer(module) or getattr(module, "_cpu_skip_gemm_dispatch", False):
            return False
    return True


class InPlaceLoad:
    """One update loaded straight into the live parameters, each tensor by its apply plan where it
    has one (plans.py), and each CPU linear layer holding a parameter it wrote packing its kernel's
    copy again: as soon as a load no longer writes the layer (a push's loads come layer by layer:
    the layer is whole then, and the pack overlaps what is still received), and at the finish for
    the rest. A layer written again after its pack is packed again."""

    def __init__(self, model: torch.nn.Module, plans: ApplyPlans) -> None:
        self.model = model
        self.plans = plans
        self._replayed_before, self._recorded_before, self._deltas_before = plans.replayed, plans.recorded, plans.deltas
        self.written: set[str] = set()
        self.load_s = 0.0
        self.repack_s = 0.0
        self.repacked = 0
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._holders: dict[int, list[torch.nn.Module]] = {}  # id(parameter): the modules holding it
        for module in model.modules():
            for param in module.parameters(recurse=False):
                self._holders.setdefault(id(param), []).append(module)
        self._unpacked: dict[int, torch.nn.Module] = {}  # id(module): written since it last packed

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        started = time.perf_counter()
        written = self.plans.load(weights, self._params)
        self.load_s += time.perf_counter() - started
        self.loaded(written)
        return written

    def load_delta(self, meta: TensorMeta, positions: torch.Tensor, values: torch.Tensor) -> set[str]:
        started = time.perf_counter()
        written = self.plans.apply_delta(meta.name, meta.dtype, meta.shape, positions, values, self._params)
        self.load_s += time.perf_counter() - started
        self.loaded(written)
        return written

    def loaded(self, names: set[str]) -> None:
        """A load wrote ``names``: the layers written before it and not by it pack their kernels."""
        self.written |= names
        if not names <= self._params.keys():  # a name that is not a parameter's: every module, at the finish
            self._unpacked.update((id(m), m) for m in self.model.modules())
            return
        now = {id(m): m for name in names for m in self._holders.get(id(self._params[name]), [])}
        self._pack([m for key, m in self._unpacked.items() if key not in now])
        self._unpacked = {key: m for key, m in self._unpacked.items() if key in now} | now

    def finish(self) -> dict:
        self._pack(list(self._unpacked.values()))
        self._unpacked = {}
        return {
            "applied": "in place",
            "base": True,  # a delta applies on the live weights themselves
            "parameters": len(self.written),
            "by_plan": self.plans.replayed - self._replayed_before,
            "deltas": self.plans.deltas - self._deltas_before,
            "plans_recorded": self.plans.recorded - self._recorded_before,
            "unplanned": self.plans.unplanned,
            "repacked": self.repacked,
            "load_s": round(self.load_s, 6),
            "repack_s": round(self.repack_s, 6),
        }

    def _pack(self, modules: list[torch.nn.Module]) -> None:
        started = time.perf_counter()
        self.repacked += pack_cpu_gemms(modules)
        self.repack_s += time.perf_counter() - started


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


def pack_cpu_gemms(modules) -> int:
    """On CPU, each linear layer among ``modules`` packs its weight again from its parameter (its
    kernel computes with the packed copy, not the parameter); how many. None on GPU."""
    packed = 0
    for module in modules:
        if getattr(module, "cpu_linear", None) is None or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue  # not a packed layer (a skipped one computes with its parameter itself)
        if module.weight.ndim == 2:
            from ..vllm_api import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            packed += 1
    return packed
