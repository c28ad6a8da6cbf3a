"""A sharded trainer's delta push: every rank of a trainer whose tensors are sharded on their first
dimension (FSDP2's DTensors, ``Shard(0)`` over one mesh dimension) compares the shard it holds with
the shard it last pushed, where it lives; only the changed elements' positions and values travel to
rank 0, which sends them to the engines through its ``GlooTrainer``. A tensor sent whole (more of it
changed than positions would save, or a push the server takes whole) is gathered to rank 0; none
that goes sparse is.

Every rank calls ``ShardedPush.push`` with its tensors, in the same order, in step: the ranks agree
through the trainer's own process group (``group``) on what each tensor sends, from the counts of
changed elements every rank reports. The group must be gloo: the counts and the ranks' answers
travel as CPU tensors, which NCCL does not take (only a gloo group over CPU tensors is tested). Rank 0 alone talks to the
server; it tells the others whether the server took the delta and whether the push landed, so that
every rank's kept shards move on only once every engine took the push. Needs only torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..client.node import SkyinferError
from ..errors import DELTA_BASE_MISMATCH, DELTA_NOT_APPLICABLE
from .delta import DENSE, changed_positions, pack_sparse, sent_as
from .gloo import GlooTrainer
from .pushing import OneCall, tensor_list

__all__ = ["ShardedPush"]


class ShardedPush:
    """One rank's side of a sharded trainer's pushes. ``trainer``: rank 0's ``GlooTrainer`` (its
    ``init()`` done), None on every other rank; ``group``: the trainer's ranks (the default group)."""

    def __init__(self, trainer: GlooTrainer | None, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        if (self.rank == 0) != (trainer is not None):
            raise ValueError("rank 0 of the trainer's group pushes through a GlooTrainer; the other ranks pass None")
        self.trainer = trainer
        self._rank_0 = dist.get_global_rank(group, 0) if group is not None else 0
        # This rank's part of each tensor as last pushed (every engine took it), and its version.
        self._kept: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        # What the last push sent per tensor (as ``Delta.changed``).
        self.last_changed: list[int] = []

    def push(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: str) -> None:
        """Push the tensors (every rank its own, in the same order) as ``version``, in one call."""
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        parts = [_part_of(tensor) for _, tensor in tensors]
        metas = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in tensors]
        update_info = {**tensor_list(metas), "packed": True, "keep_for_deltas": True}
        one_call = OneCall(version)
        ours, rows = None, None
        if self._agree_min(int(self._has_base(tensors, parts))):
            # Each tensor's changed elements here: a shard's by the rank holding it, a whole tensor's by rank 0.
            ours = [
                changed_positions(part, self._kept[name])
                if sharded or self.rank == 0
                else torch.empty(0, dtype=torch.int64, device=part.device)
                for (name, _), (part, sharded) in zip(tensors, parts)
            ]
            counts, rows = self._everyones(
                [p.numel() for p in ours] + [part.shape[0] if part.ndim else 1 for part, _ in parts]
            )
            changed = [sent_as(t, sum(int(c[i]) for c in counts)) for i, (_, t) in enumerate(tensors)]
            delta = {"base_version": self.version, "changed": changed}
            if self._decided_by_rank_0(lambda: self._server_takes({**update_info, "delta": delta}, one_call)):
                update_info["delta"] = delta
        if "delta" not in update_info:
            changed, counts = [DENSE] * len(tensors), None
        pieces = self._pieces(tensors, parts, ours, counts, rows, changed)
        self._decided_by_rank_0(lambda: self._send(update_info, pieces, one_call))
        self._took(tensors, parts, ours if "delta" in update_info else None, version)
        self.last_changed = changed

    def _has_base(self, tensors, parts) -> bool:
        return (
            self.version is not None
            and [name for name, _ in tensors] == list(self._kept)
            and all(
                self._kept[name].shape == part.shape and self._kept[name].dtype == part.dtype
                for (name, _), (part, _) in zip(tensors, parts)
            )
        )

    # -- agreeing, through the trainer's own group -----------------------------------------
    def _agree_min(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(flag.item())

    def _everyones(self, values: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Every rank's changed elements per tensor, and its rows of each (a shard's first dimension)."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        half = len(values) // 2
        return [e[:half].tolist() for e in everyone], [e[half:].tolist() for e in everyone]

    def _decided_by_rank_0(self, step) -> bool:
        """Rank 0 runs ``step`` and tells every rank its answer. A step that raised raises on rank 0
        and fails the push on the others, each forgetting its base: the engines may hold anything."""
        answer, error = 0, None
        if self.rank == 0:
            try:
                answer = 1 if step() else 0
            except BaseException as exc:  # raised below, once the other ranks know
                answer, error = -1, exc
        flag = torch.tensor([answer], dtype=torch.int64)
        dist.broadcast(flag, self._rank_0, group=self.group)
        if int(flag.item()) == -1:
            self._kept, self.version = {}, None
            if error is not None:
                raise error
            raise RuntimeError("the push failed on rank 0 of the trainer, which raised its error")
        return bool(flag.item())

    # -- rank 0 and the server -------------------------------------------------------------
    def _server_takes(self, update_info: dict, one_call: OneCall) -> bool:
        """Whether the server takes the delta (asked with ``check_only``: nothing moves)."""
        try:
            self.trainer._in_group(lambda: self.trainer._update_weights(update_info, one_call, check_only=True))
        except SkyinferError as exc:
            if exc.code not in (DELTA_BASE_MISMATCH, DELTA_NOT_APPLICABLE):
                raise
            return False
        return True

    def _send(self, update_info: dict, pieces: list[tuple[str, torch.Tensor]], one_call: OneCall) -> bool:
        def send() -> None:
            with ThreadPoolExecutor(1) as pool:
                receiving = pool.submit(self.trainer._update_weights, update_info, one_call)
                self.trainer._broadcast(pieces)
                receiving.result()

        self.trainer._in_group(send)
        return True

    # -- the pieces, on rank 0 -------------------------------------------------------------
    def _pieces(self, tensors, parts, ours, counts, rows, changed) -> list[tuple[str, torch.Tensor]]:
        """What rank 0 sends, in order: each tensor sent whole gathered (every rank takes part),
        each sparse one's positions and values sent to rank 0 by every rank that changed some."""
        from torch.distributed.tensor import DTensor

        pieces = []
        for i, ((name, tensor), (part, sharded), count) in enumerate(zip(tensors, parts, changed)):
            if count == DENSE:
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                pieces.append((name, whole.contiguous().cpu()))
            elif count > 0:
                changes = self._changes(i, part, sharded, ours[i], counts, rows)
                if changes is not None:
                    positions, values = changes
                    pieces.append((name, pack_sparse(positions.to(torch.int32), values)))
        return pieces

    def _changes(self, i: int, part: torch.Tensor, sharded: bool, positions: torch.Tensor, counts, rows):
        """On rank 0: the changed elements' flat positions in the whole tensor and their values,
        every rank's in rank order (a shard's rows follow the lower ranks'); None elsewhere."""
        if not sharded:  # rank 0 holds it whole and diffed it alone
            return (positions.cpu(), part.reshape(-1)[positions].cpu()) if self.rank == 0 else None
        row = math.prod(part.shape[1:])
        start = sum(r[i] for r in rows[: self.rank]) * row
        values = part.reshape(-1)[positions].contiguous()
        if self.rank != 0:
            if positions.numel():
                dist.send(positions + start, self._rank_0, group=self.group)
                dist.send(values, self._rank_0, group=self.group)
            return None
        all_positions, all_values = [positions + start], [values]
        for rank in range(1, len(counts)):
            n = counts[rank][i]
            if not n:
                continue
            source = dist.get_global_rank(self.group, rank) if self.group is not None else rank
            got = (
                torch.empty(n, dtype=torch.int64, device=part.device),
                torch.empty(n, dtype=part.dtype, device=part.device),
            )
            for tensor in got:
                dist.recv(tensor, source, group=self.group)
            all_positions.append(got[0])
            all_values.append(got[1])
        return torch.cat(all_positions).cpu(), torch.cat(all_values).cpu()

    # -- after the push --------------------------------------------------------------------
    def _took(self, tensors, parts, ours, version: str) -> None:
        """Every engine took the push: each rank's part of it is the next one's base (after a
        delta, only its changed elements are copied)."""
        if ours is None:
            self._kept = {name: part.clone() for (name, _), (part, _) in zip(tensors, parts)}
        else:
            for (name, _), (part, _), positions in zip(tensors, parts, ours):
                self._kept[name].view(-1)[positions] = part.reshape(-1)[positions]
        self.version = version


def _part_of(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The part of ``tensor`` this rank holds, and whether it is a shard (else every rank holds it whole)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor, False
    placements = tuple(tensor.placements)
    if placements == (Shard(0),):
        return tensor.to_local(), True
    if all(isinstance(p, Replicate) for p in placements):
        return tensor.to_local(), False
    raise ValueError(
        f"a sharded push takes tensors sharded on their first dimension over one mesh dimension, not {placements}"
    )
