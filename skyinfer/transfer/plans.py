"""Apply plans: where each checkpoint tensor of a push lands in the live model, recorded once and
replayed at every push as one copy per destination, without running the model's loaders again.

A plan is recorded the first time a tensor (by name, dtype and shape) comes, by running the model's
own ``load_weights`` over a recording tensor of its geometry, as vLLM's sharded RDT backend bakes
its plans (``sharded_rdt_fake``): the loaders' view ops (a tensor-parallel shard's ``narrow``, q
inside ``qkv_proj``) are kept as a chain, and each ``copy_`` into a parameter as its destination
region (``as_strided`` of the parameter). A loader that does anything else with the tensor's data
(a cast, arithmetic, a copy into a temporary, a broadcasting copy), or writes anything else while
it loads (a padding zeroed, a transform of the parameter after its copy), leaves its tensor
unplanned: it takes the model's loaders at every push, as before. Nothing is written while a plan is
recorded: such a write is refused before it runs. A plan is replayed only while the parameter it
writes still has the dtype, shape, strides and storage offset it was recorded against (a staged
swap may give a parameter new memory: the region is found again in the parameter's memory of the
moment); else it is recorded again.

Only the in-place load of the live model uses plans (``receiving.InPlaceLoad``): a layerwise reload
gives its layers fresh memory each update, and vLLM's own accounting of a layer's loads must see
each copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import attrs
import torch
from torch.overrides import TorchFunctionMode

from .delta import StridedView, positions_in, strided_view

__all__ = ["ApplyPlans"]

log = logging.getLogger("skyinfer.transfer.plans")

# The loaders' ops a plan may replay: pure views of the tensor given (and ``contiguous``), as vLLM's
# sharded RDT backend allows (its ``SUPPORTED_OPS``). A multi-result op (``chunk``, ``unbind``,
# ``split``) is followed by the index of the result taken.
_VIEW_OPS = {
    torch.Tensor.narrow: "narrow",
    torch.Tensor.view: "view",
    torch.Tensor.reshape: "reshape",
    torch.Tensor.__getitem__: "__getitem__",
    torch.Tensor.unsqueeze: "unsqueeze",
    torch.Tensor.squeeze: "squeeze",
    torch.Tensor.transpose: "transpose",
    torch.Tensor.t: "t",
    torch.Tensor.permute: "permute",
    torch.Tensor.flatten: "flatten",
    torch.Tensor.contiguous: "contiguous",
    torch.Tensor.chunk: "chunk",
    torch.Tensor.unbind: "unbind",
    torch.Tensor.split: "split",
}

Op = tuple[str, tuple, tuple]  # (method, positional arguments, keyword arguments as sorted items)


class _NotPlannable(Exception):
    """A loader did something with the tensor that a plan cannot replay."""


@attrs.frozen
class _Region:
    """What a parameter looked like when a copy into it was recorded, and the copy's place in it."""

    parameter: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    # The destination, within the parameter's storage.
    offset: int
    size: tuple[int, ...]
    region_stride: tuple[int, ...]

    def of(self, params: dict[str, torch.nn.Parameter]) -> torch.Tensor | None:
        """The destination in the parameter as it is now; None if the parameter changed its layout."""
        param = params.get(self.parameter)
        if param is None:
            return None
        data = param.data
        if (
            data.dtype != self.dtype
            or tuple(data.shape) != self.shape
            or data.stride() != self.stride
            or data.storage_offset() != self.storage_offset
        ):
            return None
        return data.as_strided(self.size, self.region_stride, self.offset)


@attrs.frozen
class _Copy:
    ops: tuple[Op, ...]
    region: _Region
    # The ops' result as a strided view of the checkpoint tensor (contiguous): (size, stride,
    # offset), where its elements can be found by their flat positions (delta.py); None where an op
    # copies (``contiguous`` of a transposed view).
    source: StridedView | None


@attrs.frozen
class _Fill:
    """A loader's fill of a parameter's region with a constant (a vocabulary's padding zeroed)."""

    region: _Region
    value: float


@attrs.frozen
class _Plan:
    copies: tuple[_Copy, ...]
    fills: tuple[_Fill, ...] = ()

    @property
    def writes(self) -> set[str]:
        return {step.region.parameter for step in (*self.copies, *self.fills)}

    def apply(self, tensor: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> bool:
        """Copy ``tensor`` where the plan says; False (nothing written) if a parameter changed its layout."""
        copies = [copy.region.of(params) for copy in self.copies]
        fills = [fill.region.of(params) for fill in self.fills]
        if any(dest is None for dest in (*copies, *fills)):
            return False
        for copy, dest in zip(self.copies, copies):
            dest.copy_(_replay(tensor, copy.ops))
        for fill, dest in zip(self.fills, fills):
            dest.fill_(fill.value)
        return True

    def apply_delta(self, positions: torch.Tensor, values: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> bool:
        """Write ``values`` at their flat ``positions`` of the checkpoint tensor where the plan puts
        those elements (a fill's constant is as it was); False (nothing written) if a parameter
        changed its layout. Raises ValueError where an op of the plan copies."""
        if any(copy.source is None for copy in self.copies):
            raise ValueError("its loaders copy it (not a view of it) before it lands: it takes dense pushes only")
        destinations = [copy.region.of(params) for copy in self.copies]
        if any(dest is None for dest in destinations):
            return False
        for copy, dest in zip(self.copies, destinations):
            found, index = positions_in(copy.source, positions)
            dest.index_put_(index, values[found].to(dest.dtype))
        return True


def _replay(tensor, ops: tuple[Op, ...]) -> torch.Tensor:
    for method, args, kwargs in ops:
        tensor = getattr(tensor, method)(*args, **dict(kwargs))
    return tensor


class _Recorder:
    """What one recording saw: each copy into a parameter, or the reason it cannot be planned."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.storages: dict[int, list[str]] = {}
        for name, param in params.items():
            self.storages.setdefault(param.data.untyped_storage().data_ptr(), []).append(name)
        self.copies: list[_Copy] = []
        self.fills: list[_Fill] = []

    def _region(self, dest: torch.Tensor) -> _Region:
        name = self._parameter_holding(dest)
        data = self.params[name].data
        return _Region(
            parameter=name,
            dtype=data.dtype,
            shape=tuple(data.shape),
            stride=data.stride(),
            storage_offset=data.storage_offset(),
            offset=dest.storage_offset(),
            size=tuple(dest.shape),
            region_stride=dest.stride(),
        )

    def _parameter_holding(self, dest: torch.Tensor) -> str:
        """The parameter whose elements ``dest`` lies within (parameters may share a storage)."""
        start = dest.storage_offset()
        for name in self.storages.get(dest.untyped_storage().data_ptr(), []):
            data = self.params[name].data
            span = 1 + sum((n - 1) * stride for n, stride in zip(data.shape, data.stride())) if data.numel() else 0
            if data.storage_offset() <= start < data.storage_offset() + span:
                return name
        raise _NotPlannable("a copy into a tensor that is no parameter's (a temporary, a buffer)")

    def copied(self, dest: torch.Tensor, src: _Recording) -> torch.Tensor:
        if isinstance(dest, _Recording):
            raise _NotPlannable("a copy into a recording tensor")
        if tuple(dest.shape) != tuple(src.shape):
            raise _NotPlannable(f"a broadcasting copy ({tuple(src.shape)} into {tuple(dest.shape)})")
        region = self._region(dest)
        self.copies.append(_Copy(src._ops, region, src._source()))
        return dest  # nothing moves while recording

    def filled(self, dest: torch.Tensor, value) -> torch.Tensor:
        if dest.numel() == 0:  # a padding of no rows: nothing to replay
            return dest
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _NotPlannable("a fill with something other than a number")
        self.fills.append(_Fill(self._region(dest), float(value)))
        return dest


class _Recording(torch.Tensor):
    """A tensor with a geometry and no data, standing in for a checkpoint tensor while the model's
    loaders run: its view ops are kept as a chain, its ``copy_`` into a parameter recorded, and
    anything that would read its data raises ``_NotPlannable``."""

    _ops: tuple[Op, ...]
    _meta: torch.Tensor  # the geometry, on the meta device: the checkpoint tensor's, the ops applied
    _root: torch.Tensor  # the checkpoint tensor's own (contiguous)
    _recorder: _Recorder

    @staticmethod
    def __new__(cls, meta: torch.Tensor, root: torch.Tensor, device, ops: tuple[Op, ...], recorder: _Recorder):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), dtype=meta.dtype, device=device, requires_grad=False
        )
        tensor._meta, tensor._root, tensor._ops, tensor._recorder = meta, root, ops, recorder
        return tensor

    def _source(self) -> StridedView | None:
        """Where this tensor's elements are in the checkpoint tensor, if it is a view of it."""
        meta = self._meta
        if meta is not self._root and meta._base is not self._root:
            return None  # an op copied
        return strided_view(tuple(meta.shape), meta.stride(), meta.storage_offset())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(src, cls):
                return src._recorder.copied(args[0], src)
        method = _VIEW_OPS.get(func)
        if method is not None and args and isinstance(args[0], cls):
            return args[0]._then(func, method, tuple(args[1:]), kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _NotPlannable(f"a loader reads the tensor's data ({func})")

    def _then(self, func, method: str, args: tuple, kwargs: dict):
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise _NotPlannable(f"{method} with a tensor argument")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(self._meta, *args, **kwargs)
        op: Op = (method, args, tuple(sorted(kwargs.items())))
        if isinstance(result, torch.Tensor):
            return _Recording(result, self._root, self.device, (*self._ops, op), self._recorder)
        return tuple(
            _Recording(part, self._root, self.device, (*self._ops, op, ("__getitem__", (i,), ())), self._recorder)
            for i, part in enumerate(result)
        )


def _is_write(func, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or name.startswith("__i") or name in ("__setitem__", "__set__") or "out" in kwargs


class _NoOtherWrites(TorchFunctionMode):
    """While a plan is recorded: a parameter's region filled with a constant is recorded (not run);
    any other write but a copy of the recording tensor is refused before it runs."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.fill_ and len(args) == 2 and not kwargs and not isinstance(args[0], _Recording):
            return self.recorder.filled(args[0], args[1])
        if _is_write(func, kwargs):
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if not (func is torch.Tensor.copy_ and isinstance(src, _Recording)):
                raise _NotPlannable(f"a loader writes by {getattr(func, '__name__', func)} while it loads")
        return func(*args, **kwargs)


class ApplyPlans:
    """The live model's apply plans, by (name, dtype, shape): kept for the engine's life."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._plans: dict[tuple[str, torch.dtype, tuple[int, ...]], _Plan | None] = {}
        self.recorded = 0
        self.replayed = 0
        self.deltas = 0

    @property
    def unplanned(self) -> list[str]:
        """The tensors whose loaders do more than views and copies: loaded by them at each push,
        sent whole in a delta push."""
        return sorted({key[0] for key, plan in self._plans.items() if plan is None})

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.nn.Parameter]) -> set[str]:
        """Load ``weights`` into the live model: each planned tensor by its plan, the rest through the
        model's loaders; the names of the parameters written."""
        written: set[str] = set()
        unplanned = []
        for name, tensor in weights:
            applied = self._apply(name, tensor, params)
            if applied is None:
                unplanned.append((name, tensor))
            else:
                written |= applied
        if unplanned:
            written |= self.model.load_weights(unplanned)
        return written

    def _apply(self, name: str, tensor: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> set[str] | None:
        """``tensor`` applied by its plan (recorded first if it has none): the parameters written;
        None if it has no plan (nothing written)."""
        if not tensor.is_contiguous():  # plans are recorded against the tensor as transports give it
            return None
        return self._by_plan(
            (name, tensor.dtype, tuple(tensor.shape)), tensor.device, params, lambda plan: plan.apply(tensor, params)
        )

    def apply_delta(
        self,
        name: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        positions: torch.Tensor,
        values: torch.Tensor,
        params: dict[str, torch.nn.Parameter],
    ) -> set[str]:
        """A delta of a checkpoint tensor (``values`` at its flat ``positions``) applied by its plan:
        the parameters written. ValueError if it has no plan that a delta can take."""
        written = self._by_plan(
            (name, dtype, shape), values.device, params, lambda plan: plan.apply_delta(positions, values, params)
        )
        if written is None:
            raise ValueError(
                f"{name}: its loaders do more than take views of it and copy them: it takes dense pushes only"
            )
        self.deltas += 1
        return written

    def _by_plan(self, key: tuple, device, params: dict[str, torch.nn.Parameter], apply) -> set[str] | None:
        for _ in range(2):
            if key not in self._plans:
                self._plans[key] = self._record(*key, device, params)
            plan = self._plans[key]
            if plan is None:
                return None
            if apply(plan):
                self.replayed += 1
                return plan.writes
            del self._plans[key]  # a parameter changed its layout since: recorded again against it
        return None

    def _record(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], device, params: dict[str, torch.nn.Parameter]
    ) -> _Plan | None:
        recorder = _Recorder(params)
        root = torch.empty(shape, dtype=dtype, device="meta")
        try:
            with _NoOtherWrites(recorder):
                self.model.load_weights([(name, _Recording(root, root, device, (), recorder))])
        except Exception as exc:  # whatever a loader raised at a tensor it could not read: its loaders, each push
            log.debug("%s is loaded by the model's loaders at each push: %s", name, exc)
            return None
        self.recorded += 1
        return _Plan(tuple(recorder.copies), tuple(recorder.fills))
