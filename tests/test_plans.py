"""Apply plans (skyinfer/transfer/plans.py) against the loaders they stand in for: a model whose
loaders do what vLLM's do (a shard narrowed out, q/k/v stacked into one parameter, a transposed
copy, halves of one tensor, a cast by the copy), and loaders that do more than views and a copy
(padding zeroed, a transform after the copy, arithmetic, a temporary). What a push applies by plan
must be bit for bit what the loaders write; a loader that does more keeps loading, and recording a
plan writes nothing. The real engines' case is test_weight_sync's (a dense model's push by plan,
exact against transformers)."""

from __future__ import annotations

import math

import pytest
import torch

from skyinfer.transfer.delta import DENSE, SentWeights, positions_in, strided_view
from skyinfer.transfer.packing import TensorMeta
from skyinfer.transfer.plans import ApplyPlans


def _param(*shape: int, dtype=torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class Loaders(torch.nn.Module):
    """Parameters in a serving layout, filled from checkpoint-format tensors by vLLM-like loaders."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = _param(6, 4)  # q, k, v stacked, two rows each
        self.shard = _param(2, 3)  # the second half (rows 2-3) of a 4 x 3 checkpoint tensor
        self.transposed = _param(4, 2)
        self.gate_up = _param(4, 3)  # gate and up, given as one 3 x 4 tensor, each half transposed
        self.cast = _param(5)  # float32, given bfloat16
        self.padded = _param(6, 2)  # a vocabulary padded to 6 rows
        self.exp = _param(3)  # served as -exp of what is given
        self.scaled = _param(3)
        self.via_temporary = _param(3)
        self.extra = _param(2)  # only the test writes it

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, w in weights:
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.data.narrow(0, 2 * i, 2).copy_(w)
                loaded.add("qkv")
            elif name == "shard":
                self.shard.data.copy_(w.narrow(0, 2, 2))
                loaded.add("shard")
            elif name == "transposed":
                self.transposed.data.copy_(w.t())
                loaded.add("transposed")
            elif name == "gate_up":
                gate, up = w.chunk(2, dim=1)
                self.gate_up.data[:2].copy_(gate.t())
                self.gate_up.data[2:].copy_(up.t())
                loaded.add("gate_up")
            elif name == "cast":
                self.cast.data.copy_(w)
                loaded.add("cast")
            elif name == "padded":
                self.padded[: w.shape[0]].data.copy_(w)
                self.padded[w.shape[0] :].data.fill_(0)
                loaded.add("padded")
            elif name == "exp":
                self.exp.data.copy_(w)
                self.exp.data.copy_(-torch.exp(self.exp.data))
                loaded.add("exp")
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)
                loaded.add("scaled")
            elif name == "via_temporary":
                tmp = torch.empty_like(w)
                tmp.copy_(w)
                self.via_temporary.data.copy_(tmp)
                loaded.add("via_temporary")
        return loaded


PLANNABLE = {"q", "k", "v", "shard", "transposed", "gate_up", "cast", "padded"}  # padded: its fill recorded


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (2, 4), "k": (2, 4), "v": (2, 4), "shard": (4, 3), "transposed": (2, 4), "gate_up": (3, 4),
        "padded": (4, 2), "exp": (3,), "scaled": (3,), "via_temporary": (3,),
    }  # fmt: skip
    tensors = [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]
    return [*tensors, ("cast", torch.randn(5, generator=g).to(torch.bfloat16))]


def params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def assert_same(by_plan: torch.nn.Module, by_loaders: torch.nn.Module) -> None:
    for (name, a), b in zip(by_plan.named_parameters(), by_loaders.parameters()):
        assert torch.equal(a, b), name


def test_each_push_by_plan_writes_what_the_loaders_write_and_a_plan_is_recorded_once():
    by_plan, by_loaders = Loaders(), Loaders()
    plans = ApplyPlans(by_plan)
    for push in range(3):
        # Padding the loaders zero: written beforehand, so that a plan that skipped the loader would show it.
        by_plan.padded.data.fill_(7)
        by_loaders.padded.data.fill_(7)
        written = plans.load(checkpoint(push), params(by_plan))
        by_loaders.load_weights(checkpoint(push))
        assert_same(by_plan, by_loaders)
        assert written == {name for name, _ in by_plan.named_parameters()} - {"extra"}
        assert plans.recorded == len(PLANNABLE)  # at the first push, and never again
        assert plans.replayed == len(PLANNABLE) * (push + 1)


def test_recording_a_plan_writes_nothing():
    """A loader that transforms its parameter after the copy would apply the transform twice if
    recording ran it (-exp(-exp(x))): a write during recording is refused before it runs (a fill
    with a constant, the padding's, is recorded, not run)."""
    model, reference = Loaders(), Loaders()
    model.extra.data.fill_(3)
    plans = ApplyPlans(model)
    plans.load(checkpoint(0), params(model))
    reference.load_weights(checkpoint(0))
    assert torch.equal(model.exp, reference.exp) and torch.equal(model.padded, reference.padded)
    assert torch.equal(model.extra, torch.full((2,), 3.0))


def test_a_parameter_given_new_memory_or_a_new_layout_is_written_where_it_is_now():
    """A staged swap gives parameters new memory: a plan writes the parameter as it is at the push.
    A parameter whose layout changed (another stride) has its plan recorded again."""
    model, reference = Loaders(), Loaders()
    plans = ApplyPlans(model)
    plans.load(checkpoint(0), params(model))
    model.qkv.data = torch.zeros(6, 4)  # the same layout, other memory
    model.transposed.data = torch.zeros(2, 4).t()  # the same shape, other strides
    recorded = plans.recorded
    plans.load(checkpoint(1), params(model))
    reference.load_weights(checkpoint(1))
    assert_same(model, reference)
    assert plans.recorded == recorded + 1  # the transposed parameter's plan


def _delta_pieces(delta, metas):
    """A delta's pieces as a worker takes them: (meta, positions, values) for each sparse one, and
    the tensors sent whole."""
    from skyinfer.transfer.delta import unpack_sparse

    sparse, dense = [], []
    by_name = dict(delta.pieces)
    for meta, count in zip(metas, delta.changed):
        if count > 0:
            sparse.append((meta, *unpack_sparse(by_name[meta.name], count, meta.dtype)))
        elif count == DENSE:
            dense.append((meta.name, by_name[meta.name]))
    return sparse, dense


def test_a_delta_by_plan_lands_what_a_push_of_the_whole_tensors_lands():
    """A trainer's step changes a few elements of each tensor (one 0.0 to -0.0, one to NaN, bit
    patterns a float comparison misses) and all of one: the delta sends those elements (and that
    tensor whole), nothing for a tensor unchanged; written by plan, the model holds bit for bit
    what the loaders give from the whole tensors. A perturbation and its revert round-trip."""
    first = [(name, tensor) for name, tensor in checkpoint(0) if name in PLANNABLE]
    sent = SentWeights()
    by_plan, by_loaders = Loaders(), Loaders()
    plans = ApplyPlans(by_plan)
    plans.load(first, params(by_plan))
    sent.took(first, "v0")
    step = [(name, tensor.clone()) for name, tensor in first]
    for i, (name, tensor) in enumerate(step):
        flat = tensor.view(-1)
        if name == "transposed":
            flat.add_(1)  # every element: sent whole
        elif name != "k":  # k unchanged
            flat[i % flat.numel()] = -0.0 if i % 2 else float("nan")
            flat[-1] = flat[-1] * 1.5 + 0.25
    for version, weights in (("v1", step), ("v2", first)):  # the step, then back
        delta = sent.diff(weights)
        assert delta is not None and delta.base_version == sent.version
        changed = dict(zip([n for n, _ in weights], delta.changed))
        assert changed["k"] == 0 and changed["transposed"] == DENSE
        # Two elements of 4-byte floats cost less as positions and values; of the 5 bfloat16 ones, more.
        assert changed["cast"] == DENSE and all(changed[n] in (1, 2) for n in ("q", "v", "shard", "gate_up", "padded"))
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in weights]
        sparse, dense = _delta_pieces(delta, metas)
        plans.load(dense, params(by_plan))
        for meta, positions, values in sparse:
            plans.apply_delta(meta.name, meta.dtype, meta.shape, positions, values, params(by_plan))
        by_loaders.load_weights(weights)
        for name in ("qkv", "shard", "transposed", "gate_up", "cast", "padded"):
            a, b = getattr(by_plan, name), getattr(by_loaders, name)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name  # NaN and -0.0 too
        sent.took(weights, version, delta)  # the changed elements alone copied into its base


def test_a_delta_of_a_tensor_whose_loader_does_more_is_refused():
    model = Loaders()
    plans = ApplyPlans(model)
    with pytest.raises(ValueError, match="dense pushes only"):
        plans.apply_delta(
            "exp", torch.float32, (3,), torch.tensor([1], dtype=torch.int32), torch.ones(1), params(model)
        )
    assert torch.equal(model.exp, torch.zeros(3))


@pytest.mark.parametrize("seed", range(20))
def test_positions_in_finds_every_element_of_a_view_and_no_other(seed):
    """Random chains of the loaders' view ops over a contiguous tensor: each flat position is
    found in the view exactly where the view holds it."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(n) for n in torch.randint(1, 6, (3,), generator=g))
    whole = torch.arange(math.prod(shape)).view(shape)
    view = whole
    for _ in range(3):
        op = int(torch.randint(0, 4, (1,), generator=g))
        dim = int(torch.randint(0, view.ndim, (1,), generator=g))
        if op == 0 and view.shape[dim] > 1:
            start = int(torch.randint(0, view.shape[dim] - 1, (1,), generator=g))
            view = view.narrow(dim, start, view.shape[dim] - start - 1 or 1)
        elif op == 1 and view.ndim >= 2:
            view = view.transpose(0, view.ndim - 1)
        elif op == 2:
            view = view.chunk(2, dim=dim)[-1]
        elif op == 3:
            view = view[..., ::2]
    found_view = strided_view(tuple(view.shape), view.stride(), view.storage_offset())
    assert found_view is not None
    positions = torch.arange(whole.numel())
    found, index = positions_in(found_view, positions)
    assert sorted(positions[found].tolist()) == sorted(view.reshape(-1).tolist())
    assert torch.equal(view[index], positions[found])
