"""Staged pushes, the workers' side (``StagedPush``): a push received into a staging copy on a
thread of each worker while the EngineCore generates, then swapped into the live weights between two
steps, or dropped. docs/architecture.rst: where the copy lives and how it is swapped in."""

from __future__ import annotations

import copy
import logging
import threading
import time

import torch

from ..devices import DEVICE_HEADROOM_BYTES, HOST_HEADROOM_BYTES, host_memory_available
from ..transfer.receiving import bind_thread, wait_for
from .targets import CopyTarget, ShadowTarget, WeightTarget

__all__ = ["StagedPush", "staging_place"]

log = logging.getLogger("skyinfer.engine.staging")


# The device primitives on a GPU: its free memory (the thread's device and the stream's end: receiving.py).


def _gpu_free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def _gpu_has_room(device: torch.device, nbytes: int) -> bool:
    return _gpu_free_bytes(device) - nbytes > DEVICE_HEADROOM_BYTES


def staging_place(device: torch.device, update_nbytes: int) -> tuple[torch.device, bool]:
    """Where a worker on ``device`` keeps a quantized model's push of ``update_nbytes`` (the whole
    push, decided at its first chunk): a CPU worker in its memory; a GPU worker on its GPU if it has
    room, else in pinned host memory if the host has; else refused."""
    if device.type != "cuda":
        return torch.device("cpu"), False
    if _gpu_has_room(device, update_nbytes):
        return device, False
    available = host_memory_available()
    if available - update_nbytes <= HOST_HEADROOM_BYTES:
        raise RuntimeError(
            f"no room for a staging copy of {update_nbytes / 2**30:.2f} GiB: the GPU has"
            f" {_gpu_free_bytes(device) / 2**30:.2f} GiB free, the host {available / 2**30:.2f} GiB available:"
            " push without staged"
        )
    return torch.device("cpu"), True


class StagedPush:
    """One worker's staging copy: received on a thread, then swapped in or dropped.

    vLLM runs worker calls inside the EngineCore's loop, between steps: a call that received a whole
    push would stop generation for the transfer's length. So the push is received on a thread of
    its own, through the engine's own backend aimed at a weight-update target (vLLM's supported way
    to point an update elsewhere, as adapter pushes do); ``status`` says how it goes, and
    ``swap_into`` and ``drop`` each take one worker call.

    ``shadow_of``: the live model, to stage into a shadow of it (unquantized; ``vllm_config`` is the
    worker's, which vLLM's processing of a layer reads; ``in_place``: how the swap installs it), on
    the model's own device; else the checkpoint's tensors are kept."""

    def __init__(
        self,
        engine,
        update_info: dict,
        update_nbytes: int,
        adding_to: StagedPush | None = None,
        shadow_of: torch.nn.Module | None = None,
        vllm_config=None,
        in_place: bool = False,
    ) -> None:
        self.target: WeightTarget
        self._device = engine.device
        if adding_to is not None:  # the next chunk of the same update
            self.place, self.target = adding_to.place, adding_to.target
        elif shadow_of is not None:
            # A GPU's shadow takes the memory of every parameter at once.
            shadow_nbytes = sum(p.numel() * p.element_size() for p in shadow_of.parameters())
            if self._device.type == "cuda" and not _gpu_has_room(self._device, shadow_nbytes):
                raise RuntimeError(
                    f"no room on the GPU for a staged copy of {shadow_nbytes / 2**30:.2f} GiB (the model in its"
                    " own layout, processed on the GPU as vLLM processes it at start-up): push without staged"
                )
            self.place, self.target = self._device.type, ShadowTarget(shadow_of, vllm_config, in_place)
        else:
            device, pinned = staging_place(self._device, update_nbytes)
            self.place = f"{device.type}{' pinned' if pinned else ''}"
            self.target = CopyTarget(device, pinned)
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
        if self._device.type == "cuda":
            bind_thread(self._device)
        threads = torch.get_num_threads()
        # Its own OpenMP team would take every core beside the engine's threads (on 2 cores under
        # load, steps took up to 4.5x their length while a push was staged with 2 threads).
        torch.set_num_threads(1)
        try:
            self._receiver.receive_weights(self._info)
            self.target.received()
            if self._device.type == "cuda":
                wait_for(self._device)
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
        """Swap the staged weights into ``model``: a shadow installed by the device's means, or the
        checkpoint's tensors through the model's loaders into vLLM's layerwise reload the caller
        opened; how many tensors the push staged."""
        if self.receiving or self.error is not None:
            raise RuntimeError(f"nothing staged to swap in: {self.status()}")
        self.target.swap_into(model, device)
        return len(self.target.names)

    def drop(self) -> None:
        """Throw the copy away. A receive still blocked in a collective ends with the group's own
        timeout (or its peer's death), keeping nothing more."""
        self.target.drop()
