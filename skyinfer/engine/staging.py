"""Staged pushes, the workers' side: a push received into a staging copy on a thread of each
worker while the EngineCore keeps scheduling and generating, then swapped into the live weights
between two steps.

vLLM runs worker calls inside the EngineCore's loop, between steps: a call that received a whole
push would stop generation for the transfer's length. A ``StagedPush`` is made at once; its thread
receives through the engine's own weight-transfer backend (gloo, shared memory, CUDA IPC) aimed
at a staging copy (vLLM's supported way to point an update elsewhere, as adapter pushes do), and
``status`` says how it goes. ``swap_into`` loads the copy into the live model inside one worker
call (the worker extension's ``skyinfer_swap_staged``), then the copy is dropped. ``drop`` throws a
staging copy away, the live weights untouched.

Where the copy lives, and how it is swapped in:

* on CPU (an unquantized model), in the model's own layout: a shadow of the model's modules with
  new parameters, loaded by the model's own loaders and packed for the CPU kernels on the staging
  thread; the swap points the live parameters and layers at them (no copy, no packing between two
  steps, where both cost about 0.4 s per GB);
* on a GPU, as the checkpoint's tensors, in device memory if the GPU has room for them (the copy
  into the live weights is then a device copy), else in pinned host memory; the swap loads them
  in place (CUDA graphs hold the live parameters' addresses). A quantized model's copy is loaded
  the same way, through vLLM's layerwise reload.

The staging thread computes with one thread: on a CPU the engine's threads hold every core.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

import torch

from .vllm_api import default_weight_loader, dispatch_cpu_unquantized_gemm

log = logging.getLogger("skyinfer.engine.staging")

# Free device memory a staging copy leaves for the engine's own needs (activations, graphs).
_DEVICE_HEADROOM_BYTES = 2 << 30


def pack_cpu_gemms(modules) -> int:
    """On CPU, each linear layer among ``modules`` packs its weight again from its parameter (its
    kernel computes with the packed copy, not the parameter); how many. None on GPU."""
    packed = 0
    for module in modules:
        if getattr(module, "cpu_linear", None) is None or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue  # not a packed layer (a skipped one computes with its parameter itself)
        if module.weight.ndim == 2:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            packed += 1
    return packed


class _StagingTarget(torch.nn.Module):
    """A weight-update target that keeps a copy of the checkpoint's tensors it is given, where the
    copy should live; swapped in by the model's loaders."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self.dropped = False
        self._device = device
        self._pinned = pinned

    @property
    def names(self):
        return self.tensors.keys()

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            if self.dropped:
                break
            # Receivers hand out views of buffers they reuse or release (a shared-memory segment).
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._device, pin_memory=self._pinned)
            copy.copy_(tensor.detach())
            self.tensors[name] = copy
            self.nbytes += copy.numel() * copy.element_size()
        return set(self.tensors)

    def received(self) -> None:
        pass

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> None:
        with torch.no_grad():
            model.load_weights((name, tensor.to(device, non_blocking=True)) for name, tensor in self.tensors.items())

    def drop(self) -> None:
        self.dropped = True
        self.tensors = {}


class _ShadowTarget(torch.nn.Module):
    """A weight-update target in the live model's own layout, for an unquantized model on CPU.

    The shadow is a shallow copy of each of the model's modules whose parameters are new tensors
    (of the same class and attributes, so the model's own loaders fill them as they would the live
    ones: fused projections, tensor-parallel slices, tied embeddings). A parameter is copied from
    the live one before its first sharded write only (a fused projection a push fills in part);
    one no push wrote is not swapped. Each layer a push wrote packs its kernel's weight on the
    staging thread (``received``). The swap points each live parameter at its shadow's tensor and
    each live layer at its new kernel: a few hundred pointer moves between two steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.nbytes = 0
        self.dropped = False
        self._modules_of: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}  # id(live): (live, shadow)
        self._params_of: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id(live): (live, shadow)
        self._written: set[int] = set()  # ids of live parameters a loader wrote into their shadows
        self._unpacked: set[int] = set()  # ids of live modules whose shadows were written since packed
        self._owners: dict[int, list[int]] = {}  # id(live parameter): ids of the live modules holding it
        # Not a submodule of this target: a plain attribute.
        object.__setattr__(self, "_root", self._shadow_module(model))

    def _shadow_module(self, live: torch.nn.Module) -> torch.nn.Module:
        known = self._modules_of.get(id(live))
        if known is not None:
            return known[1]  # a module reached twice (tied embeddings) has one shadow
        shadow = copy.copy(live)  # its own __dict__; the containers below are its own too
        self._modules_of[id(live)] = (live, shadow)
        shadow.__dict__["_buffers"] = dict(live._buffers)
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
        # Uninitialised: its memory is taken when a loader writes it.
        shadow = torch.Tensor._make_subclass(type(live), torch.empty_like(live.data), False)
        shadow.__dict__.update(live.__dict__)
        loader_attribute = "_weight_loader" if "_weight_loader" in live.__dict__ else "weight_loader"
        loader = live.__dict__.get(loader_attribute) or default_weight_loader
        shadow.__dict__[loader_attribute] = self._loader(live, loader)
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

    def load_weights(self, weights) -> set[str]:
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
        """Pack the kernels of the layers written since they were last packed (on this thread)."""
        if self.dropped:
            return
        pack_cpu_gemms(self._modules_of[module_id][1] for module_id in self._unpacked)
        self._unpacked.clear()

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> None:
        # Packed already: the staging thread ends with ``received``, and a failed one is never swapped.
        retired = []  # the old weights and kernels: freed off this call (1 GB takes 60 ms to unmap)
        for param_id in self._written:
            live, shadow = self._params_of[param_id]
            retired.append(live.data)
            live.data = shadow.data
        for module_id in {owner for param_id in self._written for owner in self._owners[param_id]}:
            live_module, shadow_module = self._modules_of[module_id]
            if "cpu_linear" in shadow_module.__dict__:
                retired.append(live_module.__dict__.get("cpu_linear"))
                live_module.cpu_linear = shadow_module.cpu_linear
        threading.Thread(target=retired.clear, daemon=True, name="skyinfer-retire-weights").start()

    def drop(self) -> None:
        self.dropped = True
        self._params_of.clear()
        self._modules_of.clear()
        object.__setattr__(self, "_root", None)


def _staging_place(update_nbytes: int) -> tuple[torch.device, bool]:
    if not torch.cuda.is_available():
        return torch.device("cpu"), False
    free, _total = torch.cuda.mem_get_info()
    if free - update_nbytes > _DEVICE_HEADROOM_BYTES:
        return torch.device("cuda", torch.cuda.current_device()), False
    return torch.device("cpu"), True


class StagedPush:
    """One worker's staging copy: received on a thread, then swapped in or dropped.

    ``shadow_of``: the live model, to stage into a shadow of it (CPU, unquantized); else the
    checkpoint's tensors are kept."""

    def __init__(
        self,
        engine,
        update_info: dict,
        update_nbytes: int,
        adding_to: StagedPush | None = None,
        shadow_of: torch.nn.Module | None = None,
    ) -> None:
        if adding_to is not None:  # the next chunk of the same update
            self.place, self.target = adding_to.place, adding_to.target
        elif shadow_of is not None:
            self.place, self.target = "cpu", _ShadowTarget(shadow_of)
        else:
            device, pinned = _staging_place(update_nbytes)
            self.place = f"{device.type}{' pinned' if pinned else ''}"
            self.target = _StagingTarget(device, pinned)
        # Parsed here, so that malformed metadata is refused by the call, not lost on the thread.
        self._info = engine.parse_update_info(update_info)
        # The backend's own receive, aimed at the staging copy through a shallow copy of the backend
        # (its group and settings shared): the engine's backend keeps the live model as its target,
        # whatever a receive still blocked on this thread does later.
        self._receiver = copy.copy(engine)
        self._receiver.set_weight_update_target(self.target, engine.model_config)
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._receive, daemon=True, name="skyinfer-staging")
        self._thread.start()

    def _receive(self) -> None:
        started = time.monotonic()
        threads = torch.get_num_threads()
        # Its own OpenMP team would take every core beside the engine's threads (on 2 cores under
        # load, steps took up to 4.5x their length while a push was staged with 2 threads).
        torch.set_num_threads(1)
        try:
            self._receiver.receive_weights(self._info)
            self.target.received()
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:
            self.error = exc
            log.warning("staging a push failed: %s: %s", type(exc).__name__, exc)
        finally:
            torch.set_num_threads(threads)  # the default of threads made later in this process
            self.seconds = time.monotonic() - started

    @property
    def receiving(self) -> bool:
        return self._thread.is_alive()

    def status(self) -> dict:
        if self.receiving:
            state = "receiving"
        elif self.error is not None:
            state = "failed"
        else:
            state = "staged"
        answer = {"state": state, "bytes": self.target.nbytes, "place": self.place, "tensors": len(self.target.names)}
        if self.error is not None:
            answer["error"] = f"{type(self.error).__name__}: {self.error}"
        if self.seconds is not None:
            answer["seconds"] = round(self.seconds, 4)
        return answer

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> int:
        """Swap the staged weights into ``model``: by pointer from a shadow, else through the
        model's own loaders (in place, or into vLLM's layerwise reload where the caller opened
        one); how many tensors the push staged."""
        if self.receiving or self.error is not None:
            raise RuntimeError(f"nothing staged to swap in: {self.status()}")
        self.target.swap_into(model, device)
        return len(self.target.names)

    def drop(self) -> None:
        """Throw the copy away. A receive still blocked in a collective ends with the group's own
        timeout (or its peer's death), keeping nothing more."""
        self.target.drop()
