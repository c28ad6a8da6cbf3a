"""Peer catch-up's file format: what one worker serves with, written to one shared-memory file and
copied in place from it into a peer's worker of the same rank."""

from __future__ import annotations

import json
import os
import re
import struct

import torch

from ..transfer.packing import dtype_name
from ..transfer.protocol import SEGMENT_ALIGNMENT, segment_path
from ..transfer.shm import map_segment

__all__ = ["catch_up_file", "export_tensors", "import_tensors", "served_tensors"]

# The front names the files (weights/catchup.py): skyinfer-<server token>-catchup-<id>- and the
# worker's rank. A file holds an 8-byte little-endian length, that many bytes of JSON (the index:
# each tensor's name, dtype, shape and offset from the data's start), then the data, aligned.
_CATCH_UP_PREFIX = re.compile(r"^skyinfer-[0-9a-f]{8}-catchup-[0-9a-f]{12}-$")
_INDEX_LENGTH = struct.Struct("<Q")
# os.pwrite writes at most about 2 GiB per call on Linux: larger tensors go in pieces.
_WRITE_PIECE = 1 << 30


def catch_up_file(prefix: str, rank: int) -> str:
    """The file of the worker of ``rank`` in the catch-up named ``prefix`` (no other name is taken)."""
    if not _CATCH_UP_PREFIX.match(prefix):
        raise ValueError(f"{prefix!r} is not a catch-up file prefix (skyinfer-<token>-catchup-<id>-)")
    return f"{prefix}rank{rank}"


def _aligned(n: int) -> int:
    return -(-n // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


def served_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
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
    # vLLM's CPU int8 kernel prepacks the weight into its oneDNN handler and drops the parameter:
    # a copy of the rest (the scales) would leave the old weights served under the new label.
    in_kernel_only = [
        name for name, module in model.named_modules() if "weight" in module._parameters and module.weight is None
    ]
    if in_kernel_only:
        raise RuntimeError(
            f"{len(in_kernel_only)} layer(s) keep their weights only inside their kernel (vLLM's CPU int8"
            f" kernel): {in_kernel_only[:3]}; a push brings this engine back"
        )
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
