"""Bringing an engine process to the fleet before it serves: every step, in one place.

A process that has just become ready (the first start, a crash restart, an operator's restart,
a retired engine rejoining) holds nothing of the fleet's. Before it counts as up it is brought to:

1. the fleet's residency intent (paused, or asleep at a level with the same tags awake);
2. the fleet's LoRA adapters, at the fleet's versions;
3. a colocated transport's settings (there is no group to join; a group transport's trainer
   forms its group again, told so by ``transfer_group_gone``);
4. the fleet's weights: if the fleet has had pushes since the checkpoint on disk, it is held out
   as stale, and once it counts as up it copies them from a healthy peer engine
   (``weights/catchup.py``), or waits for the next push if no peer holds them.

The steps call the new engine only, and run without the fleet's lock: a bring-up that takes
minutes (a level-1 sleep offloading a large model, adapters loading) does not hold up the admin
calls of the other engines (but for a fleet that keeps changing: below). Under the lock it then
only checks that no fleet operation completed meanwhile (``EngineRegistry.changes``) and counts as
up; if one did, the steps run again from where the engine is. After ``UNLOCKED_TRIES`` such rounds
the steps run under the lock, so that a fleet that keeps changing cannot keep an engine out for ever.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..fleet.registry import EngineRegistry
from ..fleet.state import EngineRecord, Lifecycle
from ..weights.catchup import restarted_reason

if TYPE_CHECKING:
    from ..admin.control import ControlPlane
    from ..weights.adapters import AdapterFleet
    from ..weights.catchup import CatchUp
    from ..weights.sync import WeightSync

log = logging.getLogger("skyinfer.bringup")

UNLOCKED_TRIES = 3


class Bringup:
    def __init__(
        self,
        registry: EngineRegistry,
        control: ControlPlane,
        adapters: AdapterFleet,
        sync: WeightSync,
        catch_up: CatchUp | None = None,
    ):
        self.registry = registry
        self.control = control
        self.adapters = adapters
        self.sync = sync
        self.catch_up = catch_up

    async def bring(self, record: EngineRecord) -> None:
        """Bring ``record``'s new process to the fleet and mark it up (unless it was stopped or
        died meanwhile). Raises if a step fails: on a restart the supervisor then declares it
        dead; at the service's start, ``Supervisor.wait_ready`` raises it."""
        for _ in range(UNLOCKED_TRIES):
            seen = self.registry.changes
            await self._steps(record)
            async with self.registry.lock:
                if self.registry.changes == seen:
                    self._join(record)
                    return
            log.info("engine %d: the fleet changed while it was brought to it: again", record.engine_id)
        async with self.registry.lock:
            await self._steps(record)
            self._join(record)

    async def _steps(self, record: EngineRecord) -> None:
        if not _coming_up(record):
            return
        await self.control.bring_to_intent(record)
        await self.adapters.restore(record)
        await self.sync.rejoin(record)

    def _join(self, record: EngineRecord) -> None:
        """With the fleet's lock held: nothing of the fleet's can change before it serves."""
        if not _coming_up(record):
            return  # stopped or killed meanwhile
        fleet = self.registry.fleet_weight_version
        behind = fleet is not None and record.weight_version != fleet
        if behind:
            # It loaded the checkpoint from disk: behind a fleet that has had pushes.
            self.registry.set_stale(record, restarted_reason(fleet))
        self.registry.set_lifecycle(record, Lifecycle.UP)
        if behind and self.catch_up is not None:
            # Beside bring-up, off the fleet's lock: the engine is up (stale) whatever the copy does.
            self.catch_up.after_restart(record)


def _coming_up(record: EngineRecord) -> bool:
    return record.lifecycle in (Lifecycle.STARTING, Lifecycle.RESTARTING)
