"""What a push's tensors are received into (the backend's ``set_weight_update_target``): the
``WeightTarget`` protocol, and its two kinds, a copy of the checkpoint's tensors (``CopyTarget``: a
quantized model's staged push, swapped in through vLLM's reload; a pushed adapter) and a shadow of
the live model in its own layout (``ShadowTarget``: an unquantized model's staged push, on any device)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Collection, Iterable
from typing import Protocol

import torch

from ..devices import give_back_freed_memory
from ..transfer.receiving import pack_cpu_gemms, unquantized_moe_layers
from ..vllm_api import default_weight_loader

__all__ = ["CopyTarget", "ShadowTarget", "WeightTarget"]


def _retire(tensors: list) -> None:
    """Free a swapped-out model's tensors, and give the memory back to the kernel."""
    tensors.clear()
    give_back_freed_memory()


class WeightTarget(Protocol):
    """A weight-update target: the backend's receive hands it the push's tensors (``load_weights``,
    possibly over several calls and chunks); then it is swapped into the live model or dropped."""

    nbytes: int  # the bytes received so far
    dropped: bool  # thrown away: what is still received is not kept
    installed: str  # how ``swap_into`` puts it into the live model, in words

    @property
    def names(self) -> Collection[str]:
        """The checkpoint names received so far."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take (name, tensor) pairs as a model's ``load_weights`` would; the names taken so far."""
        ...

    def received(self) -> None:
        """The receive ended: finish what it left (on the receiving thread, before any swap)."""
        ...

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> None:
        """Put what was received into the live ``model`` (between two steps of the engine)."""
        ...

    def drop(self) -> None:
        """Throw what was received away, the live weights untouched."""
        ...


class CopyTarget(torch.nn.Module):
    """Keeps a copy of each checkpoint tensor it is given, where the copy should live: a staged
    push's on the device or in pinned host memory, swapped in by the model's loaders; a pushed
    adapter's in host memory (``tensors``), which the worker writes to the adapter's file."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self.dropped = False
        self.installed = "through the model's loaders"
        self._device = device
        self._pinned = pinned

    @property
    def names(self) -> Collection[str]:
        return self.tensors.keys()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if self.dropped:
                break
            # Receivers hand out views of buffers they reuse or release (a shared-memory segment).
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._device, pin_memory=self._pinned)
            kept.copy_(tensor.detach())
            self.tensors[name] = kept
            self.nbytes += kept.numel() * kept.element_size()
        return set(self.tensors)

    def received(self) -> None:
        pass  # each tensor was copied as it came

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> None:
        with torch.no_grad():
            model.load_weights((name, tensor.to(device, non_blocking=True)) for name, tensor in self.tensors.items())

    def drop(self) -> None:
        self.dropped = True
        self.tensors = {}


class ShadowTarget(torch.nn.Module):
    """A weight-update target in the live model's own layout, for an unquantized model, on any device.

    The shadow is a shallow copy of each of the model's modules whose parameters are new tensors
    (of the same class and attributes, so the model's own loaders fill them as they would the live
    ones: fused projections, tensor-parallel slices, tied embeddings), on the live one's device (a
    GPU's memory is taken for all of them at once; a CPU's pages as a loader writes them). A
    parameter is copied from the live one before its first sharded write only (a fused projection a
    push fills in part); one no push wrote is not swapped.

    What vLLM does to a layer after loading it is done here too, on the staging thread
    (``received``), so that the swap installs weights as the engine computes with them: each CPU
    linear layer a push wrote packs its kernel's weight; a mixture-of-experts layer, whose experts
    its kernel serves converted (padded and packed on CPU, shuffled or laid out in blocks by some GPU
    kernels), takes its experts in the shapes the layer was created with and, once every element of
    them came, is processed by vLLM's own method, as at start-up (``_ShadowExperts``). Its served
    tensors cannot be read back unconverted, so a push must carry all of a layer's experts or none.
    A layer processed any other way after loading (a quantized one, a tensor an attention layer
    derives from its weights, as MLA's) is refused before the swap.

    The swap installs each written parameter by the device's own means (``in_place``): on a GPU its
    values are copied into the live tensor, whose address CUDA graphs hold; on a CPU the live
    parameter is pointed at the shadow's tensor (a pointer move, where a copy would cost about 0.4 s
    per GB between two steps). Either way the live layers take the kernels packed for them."""

    def __init__(self, model: torch.nn.Module, vllm_config, in_place: bool) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.nbytes = 0
        self.dropped = False
        self.in_place = in_place
        self.installed = "copied in place" if in_place else "by pointer"
        self._modules_of: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}  # id(live): (live, shadow)
        self._params_of: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id(live): (live, shadow)
        self._written: set[int] = set()  # ids of live parameters a loader wrote into their shadows
        self._unpacked: set[int] = set()  # ids of live modules whose shadows were written since packed
        self._owners: dict[int, list[int]] = {}  # id(live parameter): ids of the live modules holding it
        self._experts: dict[int, _ShadowExperts] = {}  # id(live MoE layer): its shadow
        self._expert_layers = {id(layer) for layer in unquantized_moe_layers(model)}
        self._vllm_config = vllm_config
        # Not a submodule of this target: a plain attribute.
        object.__setattr__(self, "_root", self._shadow_module(model))
        self._refused = _unstageable_parameters(model, self._experts)

    def _shadow_module(self, live: torch.nn.Module) -> torch.nn.Module:
        known = self._modules_of.get(id(live))
        if known is not None:
            return known[1]  # a module reached twice (tied embeddings) has one shadow
        shadow = copy.copy(live)  # its own __dict__; the containers below are its own too
        self._modules_of[id(live)] = (live, shadow)
        shadow.__dict__["_buffers"] = dict(live._buffers)
        if id(live) in self._expert_layers:
            experts = self._experts[id(live)] = _ShadowExperts(live, shadow)
            shadow.__dict__["_parameters"] = {
                name: None if p is None else experts.shadow_parameter(name, p) for name, p in live._parameters.items()
            }
        else:
            shadow.__dict__["_parameters"] = {
                name: None if p is None else self._shadow_parameter(p, live) for name, p in live._parameters.items()
            }
        shadow.__dict__["_modules"] = {
            name: None if m is None else self._shadow_module(m) for name, m in live._modules.items()
        }
        return shadow

    def _shadow_parameter(self, live: torch.nn.Parameter, module: torch.nn.Module) -> torch.nn.Parameter:
        self._owners.setdefault(id(live), []).append(id(module))  # tied: the embedding and lm_head
        known = self._params_of.get(id(live))
        if known is not None:
            return known[1]
        shadow = _shadow_parameter(live, torch.empty_like(live.data), lambda loader: self._loader(live, loader))
        self._params_of[id(live)] = (live, shadow)
        return shadow

    def _loader(self, live: torch.nn.Parameter, loader):
        def load(param, loaded_weight, *args, **kwargs):
            sharded = (args and args[0] is not None) or kwargs.get("loaded_shard_id") is not None
            if sharded and id(live) not in self._written:
                param.data.copy_(live.data)  # the parts this push may leave out
            self._written.add(id(live))
            self._unpacked.update(self._owners[id(live)])
            return loader(param, loaded_weight, *args, **kwargs)

        return load

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def counted():
            for name, tensor in weights:
                if self.dropped:
                    return
                self.names.add(name)
                self.nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        with torch.no_grad():
            self._root.load_weights(counted())
        return set(self.names)

    def received(self) -> None:
        """Refuse a push into a layer vLLM processes in a way a staged push does not redo; then, on
        this thread, pack the CPU kernels of the layers written since they were last packed and
        process the mixture-of-experts layers whose experts all came."""
        if self.dropped:
            return
        refused = sorted({self._refused[p] for p in self._written if p in self._refused})
        if refused:
            raise ValueError(
                f"a staged push cannot carry {', '.join(refused)}: vLLM processes them after loading in a way a"
                " staged push does not redo; push them without staged (the live path reloads them as vLLM does)"
            )
        pack_cpu_gemms(self._modules_of[module_id][1] for module_id in self._unpacked)
        self._unpacked.clear()
        from ..vllm_api import set_current_vllm_config

        with torch.no_grad(), set_current_vllm_config(self._vllm_config):
            for experts in self._experts.values():
                experts.process_if_whole()

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> None:
        # Processed already: the staging thread ends with ``received``, and a failed one is never swapped.
        partial = [f"{e.name} ({e.loaded} of {e.total} elements)" for e in self._experts.values() if e.partial]
        if partial:
            raise RuntimeError(
                "a staged push must carry every expert of a mixture-of-experts layer it writes (the layer"
                f" serves them converted: what it left out cannot be carried over), and part came for {', '.join(partial)}"
            )
        retired = []  # what the live model held until now: freed off this call (1 GB takes 60 ms to unmap)
        with torch.no_grad():
            for experts in self._experts.values():
                if experts.processed:
                    retired += experts.swap_in(self.in_place)
            for param_id in self._written:
                live, shadow = self._params_of[param_id]
                retired.append(_install(live, shadow.data, self.in_place))
        for module_id in {owner for param_id in self._written for owner in self._owners[param_id]}:
            live_module, shadow_module = self._modules_of[module_id]
            if "cpu_linear" in shadow_module.__dict__:
                retired.append(live_module.__dict__.get("cpu_linear"))
                live_module.cpu_linear = shadow_module.cpu_linear
        threading.Thread(target=_retire, args=(retired,), daemon=True, name="skyinfer-retire-weights").start()
        # The live model holds the new weights now. Each shadow parameter's loader refers to this
        # target, a cycle that would keep the shadows, and through them the weights the next push
        # retires, alive until a full garbage collection, which a busy engine rarely reaches.
        self._release()

    def drop(self) -> None:
        self.dropped = True
        self._release()

    def _release(self) -> None:
        self._params_of.clear()
        self._modules_of.clear()
        self._experts.clear()
        object.__setattr__(self, "_root", None)


def _install(live: torch.nn.Parameter, new: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Make ``live`` hold ``new``'s values: copied into its tensor (``in_place``) or by pointing it at
    ``new``; what the live model no longer holds (``new`` once copied, else the old tensor)."""
    if in_place:
        if new.shape != live.shape or new.dtype != live.dtype:
            raise RuntimeError(f"staged {tuple(new.shape)} {new.dtype} cannot go into {tuple(live.shape)} {live.dtype}")
        live.data.copy_(new)
        return new
    old, live.data = live.data, new
    return old


def _unstageable_parameters(model: torch.nn.Module, experts: dict) -> dict[int, str]:
    """The model's parameters a staged push may not write, by id, each with its layer's name: those
    of a layer processed after loading other than as the shadow redoes it (quantized ones), and
    those an attention layer derives tensors from after loading (MLA's ``kv_b_proj``)."""
    from ..vllm_api import UnquantizedEmbeddingMethod, UnquantizedLinearMethod, is_deferred_attention_layer

    redone = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)  # identity on GPUs; packed here on CPU
    refused = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        processed_apart = method is not None and not isinstance(method, redone) and id(module) not in experts
        if processed_apart or is_deferred_attention_layer(module):
            for param in module.parameters():  # an attention layer's too: those it derives from
                refused.setdefault(id(param), name)
    return refused


def _shadow_parameter(live: torch.nn.Parameter, data: torch.Tensor, wrap_loader) -> torch.nn.Parameter:
    """A parameter over ``data`` with ``live``'s class and attributes, its weight loader wrapped by
    ``wrap_loader`` (the model's own loaders then fill it as they would the live one)."""
    shadow = torch.Tensor._make_subclass(type(live), data, False)
    shadow.__dict__.update(live.__dict__)
    attribute = "_weight_loader" if "_weight_loader" in live.__dict__ else "weight_loader"
    shadow.__dict__[attribute] = wrap_loader(live.__dict__.get(attribute) or default_weight_loader)
    return shadow


class _ShadowExperts:
    """The shadow of one mixture-of-experts layer: its experts in the shapes the layer was created
    with (vLLM's reload keeps them), on the layer's device, counted as loaders write them, then
    converted and given a kernel by a copy of the layer's own method (``process_if_whole``);
    installed with the parameters' own means (``swap_in``)."""

    def __init__(self, live: torch.nn.Module, shadow: torch.nn.Module) -> None:
        from ..vllm_api import get_layerwise_info

        self.live, self.shadow = live, shadow
        self.name = getattr(live, "layer_name", None) or type(live).__name__
        method = copy.copy(live.quant_method)
        method.moe_kernel = None  # built for the shadow's own tensors when processed
        shadow.__dict__["quant_method"] = method
        self._created = get_layerwise_info(live).restore_metadata[0]  # name: meta tensor, as created
        self.total = sum(self._created[name].numel() for name in live._parameters if name in self._created)
        self.loaded = 0
        self.processed = False

    @property
    def partial(self) -> bool:
        return self.loaded > 0 and not self.processed

    def shadow_parameter(self, name: str, live: torch.nn.Parameter) -> torch.nn.Parameter:
        created = self._created.get(name, live.data)
        data = torch.empty(created.shape, dtype=created.dtype, device=live.device)
        return _shadow_parameter(live, data, self._counting)

    def _counting(self, loader):
        from ..vllm_api import CopyCounter

        def load(param, loaded_weight, *args, **kwargs):
            if self.processed:
                raise ValueError(f"{self.name}: its experts came twice in one staged push")
            with CopyCounter() as counter:
                result = loader(param, loaded_weight, *args, **kwargs)
            self.loaded += counter.copied_numel
            return result

        return load

    def process_if_whole(self) -> None:
        """vLLM's processing of the layer, as at start-up, once every element of its experts came."""
        if self.processed or self.loaded < self.total:
            return
        self.shadow.quant_method.process_weights_after_loading(self.shadow)
        self.processed = True

    def swap_in(self, in_place: bool) -> list[torch.Tensor]:
        """Install the processed shadow's tensors in the live layer: copied into the live tensors,
        whose kernel computes with them (as vLLM's own weight update does), or by pointer, handing
        the live layer the shadow's kernel too; what the live layer no longer holds."""
        installed = [
            (live, self.shadow._parameters[name]) for name, live in self.live._parameters.items() if live is not None
        ]
        retired = [_install(live, shadow.data, in_place) for live, shadow in installed]
        if not in_place:
            method, processed = self.live.quant_method, self.shadow.quant_method
            method.moe_kernel, method.moe_quant_config = processed.moe_kernel, processed.moe_quant_config
        return retired
