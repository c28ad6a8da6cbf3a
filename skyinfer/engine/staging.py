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

Where the copy lives: where the bytes arrive on CPU; on a GPU in device memory if the GPU has
room for it (the copy into the live weights is then a device copy), else in pinned host memory.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

import torch

log = logging.getLogger("skyinfer.engine.staging")

# Free device memory a staging copy leaves for the engine's own needs (activations, graphs).
_DEVICE_HEADROOM_BYTES = 2 << 30


class _StagingTarget(torch.nn.Module):
    """A weight-update target that keeps a copy of what it is given, where the copy should live."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self.dropped = False
        self._device = device
        self._pinned = pinned

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


def _staging_place(update_nbytes: int) -> tuple[torch.device, bool]:
    if not torch.cuda.is_available():
        return torch.device("cpu"), False
    free, _total = torch.cuda.mem_get_info()
    if free - update_nbytes > _DEVICE_HEADROOM_BYTES:
        return torch.device("cuda", torch.cuda.current_device()), False
    return torch.device("cpu"), True


class StagedPush:
    """One worker's staging copy: received on a thread, then swapped in or dropped."""

    def __init__(self, engine, update_info: dict, update_nbytes: int, adding_to: StagedPush | None = None) -> None:
        if adding_to is None:
            device, pinned = _staging_place(update_nbytes)
            self.place = f"{device.type}{' pinned' if pinned else ''}"
            self.target = _StagingTarget(device, pinned)
        else:  # the next chunk of the same update
            self.place, self.target = adding_to.place, adding_to.target
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
        try:
            self._receiver.receive_weights(self._info)
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:
            self.error = exc
            log.warning("staging a push failed: %s: %s", type(exc).__name__, exc)
        finally:
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
        answer = {"state": state, "bytes": self.target.nbytes, "place": self.place, "tensors": len(self.target.tensors)}
        if self.error is not None:
            answer["error"] = f"{type(self.error).__name__}: {self.error}"
        if self.seconds is not None:
            answer["seconds"] = round(self.seconds, 4)
        return answer

    def swap_into(self, model: torch.nn.Module, device: torch.device) -> int:
        """Load the staged tensors into ``model`` through its own loaders (in place, or into vLLM's
        layerwise reload where the caller opened one); how many."""
        if self.receiving or self.error is not None:
            raise RuntimeError(f"nothing staged to swap in: {self.status()}")
        tensors = self.target.tensors
        with torch.no_grad():
            model.load_weights((name, tensor.to(device, non_blocking=True)) for name, tensor in tensors.items())
        return len(tensors)

    def drop(self) -> None:
        """Throw the copy away. A receive still blocked in a collective ends with the group's own
        timeout (or its peer's death), keeping nothing more."""
        self.target.dropped = True
        self.target.tensors = {}
