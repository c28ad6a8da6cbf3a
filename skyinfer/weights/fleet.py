"""The fleet as a weight update sees it: its engines and their workers, the update's phase, the
checkpoint's names, and one call made to many engines at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from ..errors import DELTA_BASE_MISMATCH, DELTA_NOT_APPLICABLE, TRANSFER_GROUP_GONE, ApiError
from ..fleet.engine_calls import EngineReply, call_engine, failure
from ..fleet.registry import EngineRegistry
from ..fleet.state import APPLY, PAUSE_FOR_PUSH, EngineRecord, push_verdict
from ..transfer.protocol import UpdateMetadata
from .checkpoint import CheckpointSpec
from .phases import Phase, UpdateMachine
from .transports import FrontTransport

__all__ = ("Fleet", "SyncError", "unpushable")

# How often an unknown checkpoint (a hub id not downloaded yet) is looked for in the local cache.
_SPEC_LOOK_AGAIN_S = 10.0


class SyncError(ApiError):
    """A weight-sync call refused or failed; ``engines``: each engine's own answer."""

    def __init__(self, status: int, message: str, engines: list[dict] | None = None, code: str | None = None):
        super().__init__(message, status=status, details=None if engines is None else {"engines": engines}, code=code)


def unpushable(records: list[EngineRecord]) -> str | None:
    """Why some engines cannot take weights now (their weights asleep, a restart, ...), or None."""
    refused = [(r, v) for r in records if (v := push_verdict(r)) not in (APPLY, PAUSE_FOR_PUSH)]
    return "; ".join(f"engine {r.engine_id}: {v}" for r, v in refused) or None


class Fleet:
    """What every room of a weight update shares: the engines, the transport, the update's phase
    machine, the served checkpoint's names and the timeouts."""

    def __init__(self, registry: EngineRegistry, transport: FrontTransport, model: str, timeout_s: float, metrics):
        self.registry = registry
        self.transport = transport
        self.metrics = metrics
        self.timeout_s = timeout_s
        # The group's own timeout (from its init_info): a trainer silent this long between calls
        # of an update has gone, and an engine inside a broken collective answers after it.
        self.group_timeout_s = timeout_s
        self._model = model
        self._spec = CheckpointSpec.find(model)
        self._spec_looked_at = time.monotonic()
        self.update = UpdateMachine(metrics.set_update_phase)
        # The tensors the engines load by their loaders, no apply plan (as their pushes said): a
        # delta must send them whole.
        self.unplanned: set[str] = set()

    @property
    def spec(self) -> CheckpointSpec | None:
        """The served checkpoint's tensors, or None while they are unknown (a hub id the engines
        have not downloaded yet): looked for again until found, at most once every
        ``_SPEC_LOOK_AGAIN_S`` (a cache lookup is file I/O, and every chunk's check asks)."""
        if self._spec is None and time.monotonic() - self._spec_looked_at >= _SPEC_LOOK_AGAIN_S:
            self._spec = CheckpointSpec.find(self._model)
            self._spec_looked_at = time.monotonic()
        if self._spec is None:
            return None
        # The layers the engines serve quantized, as they report them: an online quantization's
        # too, which the checkpoint's files do not show.
        served = frozenset(layer for r in self.registry.records for layer in r.quantized_layers or ())
        if served != self._spec.served_quantized:
            self._spec = attrs.evolve(self._spec, served_quantized=served)
        return self._spec

    def serves_quantized(self) -> bool:
        """Whether the engines serve any layer quantized, as they report it."""
        return any(r.quantized_layers for r in self.registry.records)

    def workers(self, records: list[EngineRecord]) -> tuple[int, ...]:
        return tuple(self.transport.workers_per_engine[r.engine_id] for r in records)

    def engines(self) -> list[EngineRecord]:
        """Every engine of the fleet takes part in every transfer: the trainer's group spans them all."""
        members = self.registry.members()
        down = [r for r in members if not r.up]
        if down or not members:
            raise SyncError(
                409,
                "weight transfer needs every engine of the fleet: "
                + (", ".join(f"engine {r.engine_id} is {r.state.value}" for r in down) or "every engine is retired")
                + "; retry once it is up (GET /engines)",
            )
        return members

    def engines_in_group(self) -> list[EngineRecord]:
        """Every engine of the fleet, each in the trainer's group (409s say which is not)."""
        records = self.engines()
        missing = [r.engine_id for r in records if not r.in_transfer_group]
        if missing:
            raise SyncError(
                409,
                f"engines {missing} are not in the trainer's group; POST /init_weight_transfer first",
                code=TRANSFER_GROUP_GONE,
            )
        return records

    def leave_group(self) -> None:
        """Whatever broke a transfer broke the collective: the trainer must form a new group."""
        for record in self.registry.records:
            record.in_transfer_group = False

    def refuse_unless(self, *phases: Phase) -> None:
        self.update.refuse_unless(*phases, silence_limit_s=self.group_timeout_s)

    def check_metadata(self, update_info: dict, *, carries_data: bool = True) -> UpdateMetadata:
        """Refuse (400) metadata that is malformed or does not fit the served checkpoint, before any byte moves."""
        meta = self.transport.parse_update(update_info, carries_data=carries_data)
        self._refuse_unless_fits(lambda spec: spec.check(meta))
        return meta

    def refuse_delta_unless_every_engine_takes_it(
        self, meta: UpdateMetadata, records: list[EngineRecord], staged: bool
    ) -> None:
        """Refuse a delta push (``update_info.delta``) that an engine cannot take, before any byte
        moves: one that serves another version than its base, or keeps nothing to apply it on (a
        new process, a catch-up, a push whose trainer asked for no copy: 409 ``delta_base_mismatch``),
        or one whose tensors a delta cannot reach (409 ``delta_not_applicable``)."""
        delta = getattr(meta, "delta", None)
        if delta is None:
            return
        if staged:
            raise SyncError(400, "a staged push is sent whole: push without update_info.delta")
        if self.spec is None:
            raise SyncError(
                409,
                "the served checkpoint's tensors are unknown here: push without update_info.delta",
                code=DELTA_NOT_APPLICABLE,
            )
        sparse = [name for name, count in zip(meta.names, delta.changed) if count > 0 and name in self.unplanned]
        if sparse:
            raise SyncError(
                409,
                f"the engines load {', '.join(sparse[:3])}{' and more' if len(sparse) > 3 else ''} by their model's"
                " loaders, which a delta cannot go through: send them whole",
                code=DELTA_NOT_APPLICABLE,
            )
        off = [r for r in records if r.delta_base != delta.base_version or r.stale is not None]
        if off:
            serving = ", ".join(
                f"engine {r.engine_id}: {r.weight_version}{' (stale)' if r.stale else ''}"
                f"{'' if r.delta_base == r.weight_version else ', keeping no base to apply a delta on'}"
                for r in off
            )
            raise SyncError(
                409,
                f"update_info.delta applies on {delta.base_version!r}, which not every engine serves ({serving}):"
                " push dense",
                code=DELTA_BASE_MISMATCH,
            )

    def check_whole_update(self, names: Iterable[str], why: str = "update_info rejected before any transfer") -> None:
        """Refuse (400) a whole update (a start's metadata, a one-call push's, what a staged push
        received before its swap) that carries part of a mixture-of-experts layer's experts or of a
        quantized layer (as the checkpoint stores it, or as the engines serve it), before any live
        weight is touched."""
        self._refuse_unless_fits(lambda spec: spec.check_whole_layers(names), why)

    def _refuse_unless_fits(
        self, check: Callable[[CheckpointSpec], None], why: str = "update_info rejected before any transfer"
    ) -> None:
        """``check`` against the served checkpoint (where its names are known); its ValueError a 400."""
        if (spec := self.spec) is not None:
            try:
                check(spec)
            except ValueError as exc:
                raise SyncError(400, f"{why}: {exc}") from None

    def missing(self, received: set[str]) -> list[str] | None:
        """The checkpoint's tensors an update left out; None where the checkpoint's names are unknown."""
        spec = self.spec
        return spec.missing(received) if spec is not None else None

    async def call_all(
        self, records: list[EngineRecord], path: str, *, timeout_s: float | None = None, **call: Any
    ) -> list[EngineReply]:
        """One engine route called on each engine at once; each engine's reply, in order."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return await asyncio.gather(*(call_engine(r, path, timeout_s=timeout_s, **call) for r in records))

    @staticmethod
    def raise_if_failed(step: str, replies: list[EngineReply]) -> None:
        failed = failure(step, replies)
        if failed is not None:
            raise SyncError(*failed, [rep.as_json() for rep in replies])
