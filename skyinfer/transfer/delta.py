"""Delta pushes, both sides: a trainer sends only the elements its step changed, and each engine
worker writes them where its apply plans put those elements (plans.py).

The trainer's side (``SentWeights``) keeps what it last pushed that every engine took, compares
each tensor of the next push with it bit for bit (integer views: NaN and -0.0 are exact), and sends
per tensor nothing (unchanged), the changed elements' flat positions and values (a sparse piece),
or the whole tensor (where positions would cost more). ``update_info.delta`` names the version the
delta applies on and, per tensor, what was sent (``changed``: 0, the count of changed elements, or
``DENSE``); both sides cut the same pieces from it (``delta_pieces``) and pack them by the rule of
any packed push. Needs only torch: the trainer side must not import vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from .layers import layer_of
from .packing import TensorMeta
from .protocol import sparse_nbytes

__all__ = [
    "DENSE",
    "Delta",
    "KeptBase",
    "SentWeights",
    "StridedView",
    "changed_positions",
    "check_positions",
    "delta_pieces",
    "pack_sparse",
    "positions_in",
    "sent_as",
    "strided_view",
    "unpack_sparse",
]

# ``changed`` of a tensor sent whole.
DENSE = -1
# A sparse piece's positions are int32: a tensor of more elements goes dense.
MAX_SPARSE_ELEMENTS = 2**31 - 1
_INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

StridedView = tuple[tuple[int, ...], tuple[int, ...], int]  # (size, stride, storage offset)


def _positions_nbytes(count: int) -> int:
    return sparse_nbytes(count, 0)


def delta_pieces(metas: Sequence[TensorMeta], changed: Sequence[int]) -> list[TensorMeta]:
    """What a delta push carries, in order: each tensor sent whole, and one uint8 piece (positions,
    then values) for each tensor sent sparse; nothing for an unchanged one."""
    pieces = []
    for meta, count in zip(metas, changed):
        if count == DENSE:
            pieces.append(meta)
        elif count > 0:
            pieces.append(TensorMeta(meta.name, torch.uint8, (sparse_nbytes(count, meta.dtype.itemsize),)))
    return pieces


def unpack_sparse(piece: torch.Tensor, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse piece's positions (int32) and values (views into it, or into an aligned copy)."""
    if piece.data_ptr() % 8:  # packed back to back after a tensor of odd size
        piece = piece.clone()
    values = piece[_positions_nbytes(count) :][: count * dtype.itemsize]
    return piece[: 4 * count].view(torch.int32), values.view(dtype)


def pack_sparse(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    count = positions.numel()
    piece = torch.zeros(sparse_nbytes(count, values.dtype.itemsize), dtype=torch.uint8, device=values.device)
    piece[: 4 * count].view(torch.int32).copy_(positions)
    piece[_positions_nbytes(count) :][: count * values.element_size()].view(values.dtype).copy_(values)
    return piece


def changed_positions(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The flat positions of the elements of ``new`` that differ from ``old``'s bit for bit."""
    integer = _INTEGER_OF_SIZE[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(integer) != old.reshape(-1).view(integer)).squeeze(1)


def sent_as(tensor: torch.Tensor, count: int) -> int:
    """What a tensor of ``count`` changed elements sends (``Delta.changed``): nothing, a sparse
    piece, or the whole tensor where positions would cost more."""
    if count == 0:
        return 0
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.numel() <= MAX_SPARSE_ELEMENTS and sparse_nbytes(count, tensor.element_size()) < nbytes:
        return count
    return DENSE


@attrs.frozen
class Delta:
    """One push as a delta: the version it applies on, what was sent per tensor, and the tensors
    to send (each whole, or a sparse piece)."""

    base_version: str
    changed: list[int]
    pieces: list[tuple[str, torch.Tensor]]
    # The flat positions of the changed elements of each tensor that changed.
    positions: dict[str, torch.Tensor]

    def update_info(self) -> dict:
        return {"base_version": self.base_version, "changed": self.changed}


class SentWeights:
    """What a trainer last pushed that every engine took (a copy of each tensor, on the trainer's
    side), and its version: the base of its next push's delta."""

    def __init__(self) -> None:
        self.version: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def diff(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> Delta | None:
        """``tensors`` as a delta on what was last pushed; None where there is no base (nothing
        pushed yet, or other tensors)."""
        if self.version is None or [(n, t.dtype, t.shape) for n, t in tensors] != [
            (n, t.dtype, t.shape) for n, t in self._tensors.items()
        ]:
            return None
        changed, pieces, changes = [], [], {}
        for name, tensor in tensors:
            positions = changed_positions(tensor, self._tensors[name])
            count = sent_as(tensor, positions.numel())
            changed.append(count)
            if count == 0:
                continue
            changes[name] = positions
            if count == DENSE:
                pieces.append((name, tensor))
            else:
                pieces.append((name, pack_sparse(positions, tensor.reshape(-1)[positions])))
        return Delta(self.version, changed, pieces, changes)

    def took(self, tensors: Sequence[tuple[str, torch.Tensor]], version: str, delta: Delta | None = None) -> None:
        """Every engine took ``tensors`` as ``version`` (sent as ``delta``, a diff of them on this
        base, or whole): the next push's base. After a delta, only its changed elements are copied."""
        if [n for n, _ in tensors] != list(self._tensors):
            self._tensors = {name: tensor.detach().clone() for name, tensor in tensors}
        elif delta is None or delta.base_version != self.version:
            for name, tensor in tensors:
                self._tensors[name].copy_(tensor)
        else:
            by_name = dict(tensors)
            for name, positions in delta.positions.items():
                self._tensors[name].view(-1)[positions] = by_name[name].reshape(-1)[positions]
        self.version = version

    def forget(self) -> None:
        """No base: the next push goes dense (an engine may serve something else now)."""
        self.version = None
        self._tensors = {}


def check_positions(meta: TensorMeta, positions: torch.Tensor) -> None:
    """Refuse a sparse piece whose positions are not each element once, in order, within the tensor."""
    if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise ValueError(f"the delta of {meta.name} gives its positions out of order or twice")
    if positions.numel() and not 0 <= int(positions[0]) <= int(positions[-1]) < math.prod(meta.shape):
        raise ValueError(f"the delta of {meta.name} gives positions outside its {math.prod(meta.shape)} elements")


class KeptBase:
    """A worker's copy of the checkpoint tensors its live model took, for a model whose layers
    cannot be read back as loaded (vLLM processes experts and quantized layers after loading:
    packed, padded, quantized kernels' layouts): a delta is applied to this copy, and each layer it
    touched is reloaded whole from it, through vLLM's layerwise reload. Host memory as large as the
    tensors pushed, kept only while the trainer's pushes ask for it (``keep_for_deltas``).

    It serves as a base only while it is what the model serves: an update that did not keep what
    it loaded (a reload from disk, a staged swap, a push that failed or did not ask) drops it, and
    so does any write into the live weights outside an update (``forget``)."""

    def __init__(self, model) -> None:
        self.model = model
        self.tensors: dict[str, torch.Tensor] = {}
        self.current = False
        # The update open on the live model, if any: whether the copy was current at its start,
        # whether each of its chunks asked to keep it (None: no chunk came, as in a reload from
        # disk), and the tensors a delta of it changed.
        self.open = False
        self._was_current = False
        self.keeping: bool | None = None
        self._touched: set[str] = set()
        self.deltas = 0

    def begin(self) -> None:
        self._was_current, self.current = self.current, False
        self.open, self.keeping, self._touched, self.deltas = True, None, set(), 0

    def chunk(self, keep: bool) -> None:
        """A chunk of the open update came, asking to keep what it carries (or not)."""
        if self.keeping is None and keep and not self._was_current:
            self.tensors = {}  # not what the model serves: rebuilt from this update's tensors
        self.keeping = keep if self.keeping is None else self.keeping and keep
        if not self.keeping:
            self.tensors = {}

    def failed(self) -> None:
        self.keeping, self.tensors = False, {}

    def put(self, weights: Sequence[tuple[str, torch.Tensor]], *, of_delta: bool = False) -> None:
        """Keep ``weights`` as loaded (``of_delta``: sent whole in a delta, their layers reloaded from here)."""
        for name, tensor in weights:
            kept = self.tensors.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                self.tensors[name] = tensor.detach().to("cpu", copy=True)
            else:
                kept.copy_(tensor)
            if of_delta:
                self._touched.add(name)

    def apply(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write a delta of one tensor (``values`` at its flat ``positions``) into the copy."""
        if not (self.keeping and self._was_current):
            raise ValueError("this worker keeps no copy of the weights it serves to apply a delta on: push dense")
        kept = self.tensors.get(name)
        if kept is None:
            raise ValueError(f"{name} was not in the push this worker keeps a copy of: push dense")
        kept.view(-1)[positions.to("cpu", torch.int64)] = values.to("cpu", kept.dtype)
        self._touched.add(name)
        self.deltas += 1

    def to_reload(self) -> list[tuple[str, torch.Tensor]]:
        """Each kept tensor of each layer a delta of the open update touched: that layer reloaded whole."""
        layers = {layer_of(name) for name in self._touched}
        return [(name, tensor) for name, tensor in self.tensors.items() if layer_of(name) in layers]

    def end(self, finished: bool) -> None:
        """The open update ended (``finished``: every chunk and its finish went through)."""
        self.current = finished and bool(self.keeping)
        if not self.current:
            self.tensors = {}
        self.open, self._touched = False, set()

    def forget(self) -> None:
        self.current, self.tensors = False, {}


def strided_view(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> StridedView | None:
    """``(size, stride, offset)`` if each element of such a view of a contiguous tensor is found
    from its flat position by dividing by the strides, largest first (``positions_in``): each
    stride larger than the span of the smaller ones, as views by narrow, transpose, split and
    reshape give; else None."""
    dims = sorted((d for d in range(len(size)) if size[d] > 1), key=lambda d: -stride[d])
    for i, d in enumerate(dims):
        span = sum((size[e] - 1) * stride[e] for e in dims[i + 1 :])
        if stride[d] <= span:
            return None
    return size, stride, offset


def positions_in(view: StridedView, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Which of ``positions`` (flat, in the contiguous tensor) lie in ``view``, and their index in it."""
    size, stride, offset = view
    rest = positions.to(torch.int64) - offset
    found = rest >= 0
    if math.prod(size) == 0:
        found = torch.zeros_like(found)
    index: list[torch.Tensor | None] = [None] * len(size)
    for d in sorted((d for d in range(len(size)) if size[d] > 1), key=lambda d: -stride[d]):
        at = torch.div(rest, stride[d], rounding_mode="floor")
        found &= (at >= 0) & (at < size[d])
        rest = rest - at * stride[d]
        index[d] = at
    found &= rest == 0
    whole = tuple(torch.zeros_like(rest) if at is None else at for at in index)
    return found, tuple(at[found] for at in whole)
