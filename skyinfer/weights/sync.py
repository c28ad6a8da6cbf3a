"""The front's side of weight sync, as one front door: ``WeightSync`` holds the rooms of a weight
update (the fleet, the transfer group, the push, the checks) and the trainer's silence timer.

Nothing touches an engine's weights before the update's metadata has been checked, and every step
that needs the fleet runs with the registry's lock held, its phase checked again under it. How an
update runs, and fails, is in ``push.py``; the phases in ``phases.py``; the routes in ``routes.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from ..admin.metrics import ServiceMetrics
from ..fleet.registry import EngineRegistry
from ..fleet.state import EngineRecord
from ..wire import Checksums
from .checking import WeightChecks
from .checkpoint import describe_quantization
from .fleet import Fleet, SyncError
from .group import TransferGroup
from .phases import Phase, UpdateMachine
from .push import Push
from .transports import FrontTransport

if TYPE_CHECKING:
    from ..admin.control import ControlPlane
    from ..fleet.supervisor import Supervisor

__all__ = ("WEIGHT_SYNC", "SyncError", "WeightSync")

log = logging.getLogger("skyinfer.weights")


class WeightSync:
    def __init__(
        self,
        registry: EngineRegistry,
        transport: FrontTransport,
        model: str,
        timeout_s: float,
        supervisor: Supervisor,
        control: ControlPlane,
        metrics: ServiceMetrics,
        max_push_failures: int,
        online_quantization: str | None = None,
    ):
        self.registry = registry
        self.online_quantization = online_quantization
        self.fleet = Fleet(registry, transport, model, timeout_s, metrics)
        self.checks = WeightChecks(self.fleet)
        self.push = Push(self.fleet, self.checks, supervisor, control, max_push_failures)
        self.group = TransferGroup(self.fleet, self.push)
        # An update the silence timer is ending (kept: the loop holds tasks only weakly).
        self._abandoning: asyncio.Task | None = None

    @property
    def transport(self) -> FrontTransport:
        return self.fleet.transport

    @transport.setter
    def transport(self, transport: FrontTransport) -> None:
        self.fleet.transport = transport

    @property
    def update(self) -> UpdateMachine:
        return self.fleet.update

    @property
    def updates_begun(self) -> int:
        return self.push.updates_begun

    @property
    def worker_count(self) -> int:
        """The inference side of the group (vLLM's ``/get_world_size``): the fleet's workers (a
        retired engine is out of it)."""
        return sum(self.fleet.workers(self.registry.members()))

    # -- the trainer's silence -----------------------------------------------------------
    def call_began(self) -> None:
        """A weight call is running (or waits for the fleet): the update's silence timer stops."""
        self.update.call_began()

    def call_ended(self, accepted: bool) -> None:
        """A weight call is over: during an update, the trainer's next call is due within the
        group's timeout of its last accepted one, or the update is abandoned."""
        self.update.call_ended(accepted, self.fleet.group_timeout_s, self._trainer_silent)

    def _trainer_silent(self) -> None:
        phase = self.update.phase
        reason = (
            f"the trainer sent nothing for {self.fleet.group_timeout_s:.0f}s during a weight update ({phase.value})"
        )
        log.error("%s: aborting it", reason)
        self._abandoning = asyncio.create_task(self._abandon(phase, reason))

    async def _abandon(self, phase: Phase, reason: str) -> None:
        async with self.registry.fleet_change():
            if self.update.phase is not phase or not self.update.silence_timed_out:
                return  # the trainer came back meanwhile, or the update ended
            await self.push.end_abandoned(reason)

    # -- what the rest of the front asks of weight sync --------------------------------
    async def rejoin(self, record: EngineRecord) -> None:
        await self.group.rejoin(record)

    def transfer_members(self) -> list[EngineRecord]:
        return self.group.members()

    def group_broken(self, reason: str) -> None:
        self.group.broken(reason)

    def agreed_checksums(self) -> Checksums | None:
        return self.checks.agreed()

    def quantization(self) -> dict | None:
        """What the engines serve quantized and what a push must carry (None: full precision)."""
        return describe_quantization(self.fleet.spec, self.online_quantization)

    def info(self) -> dict:
        return {
            "weight_version": self.registry.fleet_weight_version,
            "transport": self.transport.transport.name,
            "quantization": self.quantization(),
            "update_in_progress": self.update.phase is not Phase.IDLE,
            **self.update.describe(),
            "last_update_seconds": self.push.last_update_s,
            # The last push that finished: its seconds from its first call, and each stage's.
            "last_push": self.push.last_push,
            "last_staged_swap": self.push.last_staged_swap,
            # LoRA adapters: name -> the version the fleet serves it at.
            "adapters": {name: adapter.version for name, adapter in self.registry.fleet_adapters.items()},
            "engines": [
                {
                    "engine": r.engine_id,
                    "weight_version": r.weight_version,
                    "state": r.state.value,
                    "stale_reason": r.stale,
                    "receiving": r.mid_update,
                    "in_transfer_group": r.in_transfer_group,
                    "rendezvous": r.rendezvous,
                    "push_failures": r.push_failures,
                    "adapters": dict(r.adapters),
                }
                for r in self.registry.records
            ],
        }


WEIGHT_SYNC = web.AppKey("weight_sync", WeightSync)
