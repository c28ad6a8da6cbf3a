"""A weight update's phases, as one machine: where the fleet is, which step may follow which,
and which calls fit each phase. ``skyinfer/fleet/state.py`` does the same for engines.

- ``IDLE``: no update. ``STARTED``: ``/start_weight_update`` seen, its metadata checked, no engine
  touched. ``STAGING``: a staged push is received into staging copies while the engines serve on,
  their live weights untouched (an end here costs nothing). ``RECEIVING``: engines are between
  vLLM's start and finish, their layers part new.
- ``abandoned``: why the server itself ended the last update its trainer had opened and not
  ended (the trainer fell silent, a new trainer set up a transfer, an engine failed it). Every
  later chunk, finish or verify of that update is refused with ``UPDATE_ABANDONED`` until the
  trainer starts over (``/start_weight_update``, ``/init_weight_transfer``): a chunk must never be
  taken for a new update of its own, or rollouts run on a mix of layers.
- ``current``: the open update's own data (``OpenUpdate``), made when it leaves ``IDLE`` and
  dropped when it ends.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from ..errors import UPDATE_ABANDONED, ApiError

if TYPE_CHECKING:
    from ..fleet.state import EngineRecord
    from ..transfer.protocol import UpdateMetadata

__all__ = ("OpenUpdate", "Phase", "UpdateMachine", "UpdateRefused")

log = logging.getLogger("skyinfer.weights")


class Phase(enum.Enum):
    """Where the fleet is in a weight update; a transfer group may be formed or not in any of them."""

    IDLE = "idle"
    STARTED = "started"
    STAGING = "staging"
    RECEIVING = "receiving"


P = Phase
# Which step may follow which; anything else is a bug in the caller.
_PHASE_STEPS: dict[Phase, frozenset[Phase]] = {
    # A start opens an update; a one-call /update_weights begins receiving at once, or staging.
    P.IDLE: frozenset({P.STARTED, P.RECEIVING, P.STAGING}),
    # The first chunk begins it on the engines (or their staging copies); an update nobody began
    # ends without touching them.
    P.STARTED: frozenset({P.RECEIVING, P.STAGING, P.IDLE}),
    # The finish swaps the staged copies in; an end before it drops them.
    P.STAGING: frozenset({P.RECEIVING, P.IDLE}),
    # Finished, or aborted on every engine.
    P.RECEIVING: frozenset({P.IDLE}),
}

# What to call next, by phase, when a call does not fit it.
_HINTS = {
    P.IDLE: "no weight update is in progress; POST /start_weight_update or /update_weights first",
    P.STARTED: "a weight update is started; POST /update_weights next",
    P.STAGING: "a staged update is open; POST /update_weights for more of it, or /finish_weight_update",
    P.RECEIVING: "a weight update is in progress; POST /finish_weight_update first",
}


class UpdateRefused(ApiError):
    """A weight-sync call that does not fit the update's phase: 409."""

    status = 409


@attrs.define
class OpenUpdate:
    """One update's own data, from the call that opens it to its end (each field says who sets it)."""

    # When it left IDLE (``UpdateMachine.step``): a push's time runs from here to its finish.
    started_at: float = 0.0
    # Received into staging copies while the engines serve on (``start``, or a one-call push).
    staged: bool = False
    # The engines hold staging copies of it (the staged path's receive); its swap consumes them,
    # its end drops them.
    copies_held: bool = False
    # A staged push's bytes per GPU worker, as far as known at its start (its metadata, else the
    # checkpoint's): each engine places its copy for the whole push, not its first chunk.
    staging_bytes: int = 0
    # Engines it paused itself (the live path's begin), resumed when it ends.
    paused_for_push: list[EngineRecord] = attrs.Factory(list)
    # The tensors it carried (``receive``/``stage``): its finish knows whether it covered the checkpoint.
    received: set[str] = attrs.Factory(set)
    # It loads the whole checkpoint on disk (``/reload_weights``), whatever its names.
    whole_checkpoint: bool = False
    # Opened by /start_weight_update: its trainer makes further calls that belong to it.
    opened_by_trainer: bool = False
    # When its trainer's next call is due: set by each weight call the server accepted, never by
    # a refused one (an operator retrying a refused call must not keep a dead trainer's update open).
    silence_deadline: float | None = None
    # Fires at ``silence_deadline`` (armed as a weight call ends, stopped while one runs).
    silence_timer: asyncio.TimerHandle | None = None
    # Each engine that holds a staging copy of it, and the process that holds it (the staged
    # path's receive): a process that replaced it since holds none.
    stagers: dict[int, int | None] = attrs.Factory(dict)
    # Seconds the front spent in each stage of it, in the order the stages came (``Push.timed``):
    # what ``/weight_info`` shows of the last push that finished.
    stages: dict[str, float] = attrs.Factory(dict)
    # How its trainer's calls gave the tensors (protocol.py's layouts): "given" (in full, with
    # the layout's id), "named" (its id alone), None (in full, no layout: vLLM's clients).
    layout: str | None = None
    # The bytes its receives moved, and the bytes of the tensors they carry whole (a delta push moves fewer).
    bytes_sent: int = 0
    bytes_dense: int = 0
    # When its first stage began: a one-call push pauses engines before it leaves IDLE.
    first_stage_at: float | None = None
    # Seconds of the stages run inside the stage that runs now (a one-call push's pause and start
    # come inside its receive): not that stage's own.
    nested_s: float = 0.0

    def receiving(self, update_info: dict, meta: UpdateMetadata) -> None:
        """A receive of ``meta`` (as the trainer sent it, ``update_info``) is under way."""
        if meta.layout is not None:
            self.layout = "given" if "names" in update_info else "named"
        delta = getattr(meta, "delta", None)
        self.bytes_dense += meta.total_bytes()
        self.bytes_sent += meta.total_bytes() if delta is None else delta.sent_bytes(meta)

    def account(self) -> dict:
        """What ``/weight_info``'s ``last_push`` says of how its tensors came."""
        answer = {"layout": self.layout} if self.layout else {}
        if self.bytes_dense:
            answer["bytes"] = {"sent": self.bytes_sent, "dense": self.bytes_dense}
        return answer


class UpdateMachine:
    def __init__(self, on_step: Callable[[Phase], None]):
        self.phase = Phase.IDLE
        self.abandoned: str | None = None
        self.current = OpenUpdate()
        self._on_step = on_step
        # Weight calls begun; how many had when the silence timer last fired, and the deadline it fired for.
        self._calls_begun = 0
        self._calls_at_silence = -1
        self._deadline_at_silence: float | None = None

    @property
    def received(self) -> set[str]:
        return self.current.received

    def step(self, new: Phase) -> None:
        old = self.phase
        if new is old:
            return
        if new not in _PHASE_STEPS[old]:
            raise RuntimeError(f"weight update: illegal step {old.value} -> {new.value}")
        log.info("weight update: %s -> %s", old.value, new.value)
        self.phase = new
        if old is Phase.IDLE:
            self.current.started_at = time.monotonic()
        if new is Phase.IDLE:
            self._disarm()
            self.current = OpenUpdate()
        self._on_step(new)

    def open(self, staged: bool) -> None:
        """``/start_weight_update``: a new update, whatever the trainer left before."""
        self.abandoned = None
        self.current.opened_by_trainer = True
        self.current.staged = staged
        self.step(Phase.STARTED)

    def call_began(self) -> None:
        """A weight call is running, or waits for the fleet: the silence timer stops meanwhile."""
        self._calls_begun += 1
        self._disarm()

    def call_ended(self, accepted: bool, limit_s: float, on_silent: Callable[[], None]) -> None:
        """A weight call is over. One the server accepted shows the trainer alive: during an update,
        its next call is due within ``limit_s``. A refused one (4xx) shows nothing: the deadline
        stays where the last accepted call put it, and the timer runs on to it."""
        if self.phase is Phase.IDLE:
            return
        if accepted:
            self.current.silence_deadline = time.monotonic() + limit_s
        deadline = self.current.silence_deadline
        if deadline is not None:
            self._disarm()
            delay = max(0.0, deadline - time.monotonic())
            self.current.silence_timer = asyncio.get_running_loop().call_later(delay, self._silent, on_silent)

    def _disarm(self) -> None:
        if self.current.silence_timer is not None:
            self.current.silence_timer.cancel()
            self.current.silence_timer = None

    def _silent(self, on_silent: Callable[[], None]) -> None:
        self.current.silence_timer = None
        self._calls_at_silence = self._calls_begun
        self._deadline_at_silence = self.current.silence_deadline
        on_silent()

    @property
    def silence_timed_out(self) -> bool:
        """The silence timer fired for the deadline that still stands, and no weight call began
        since (one that did, waiting for the fleet, may be the trainer's: it is judged when it
        ends). The timer's firing is the verdict, not a reading of the clock against the deadline:
        the event loop runs a timer up to a millisecond before its time (uvloop's resolution), and
        an update whose timer fired then was never abandoned (a dead trainer's, in test_colocated)."""
        deadline = self.current.silence_deadline
        return (
            self.phase is not Phase.IDLE
            and deadline is not None
            and deadline == self._deadline_at_silence
            and self._calls_at_silence == self._calls_begun
        )

    def receive(self, names: Iterable[str]) -> None:
        self.received.update(names)
        self.step(Phase.RECEIVING)

    def stage(self, names: Iterable[str]) -> None:
        self.received.update(names)
        self.step(Phase.STAGING)

    def end(self, abandoned_because: str | None = None) -> None:
        """The update is over. ``abandoned_because``: the server ended it, not its trainer; if the
        trainer had opened it, its later calls are refused until it starts over."""
        if abandoned_because is not None and self.current.opened_by_trainer:
            self.abandoned = abandoned_because
        self.step(Phase.IDLE)

    def start_over(self) -> None:
        """The trainer set up a transfer (or left it): nothing it sent before counts any more."""
        self.abandoned = None

    def refuse_unless(self, *phases: Phase, silence_limit_s: float) -> None:
        """409 unless the fleet is in one of ``phases``; a call that belongs to an abandoned
        update is refused with ``UPDATE_ABANDONED``, which tells a trainer to start over."""
        if self.phase is Phase.IDLE and self.abandoned is not None and Phase.IDLE not in phases:
            raise self._abandoned_error()
        if self.phase not in phases:
            raise UpdateRefused(
                f"{_HINTS[self.phase]} (an update the trainer leaves for {silence_limit_s:.0f}s is aborted)"
            )

    def refuse_if_abandoned(self) -> None:
        """A chunk sent while no update is open would be taken as a whole update of its own: not
        while the trainer's last update lies abandoned."""
        if self.phase is Phase.IDLE and self.abandoned is not None:
            raise self._abandoned_error()

    def _abandoned_error(self) -> UpdateRefused:
        return UpdateRefused(
            f"the weight update this call belongs to was abandoned by the server ({self.abandoned}); nothing of it"
            " is served: start over with POST /start_weight_update (or /init_weight_transfer)",
            code=UPDATE_ABANDONED,
        )

    def describe(self) -> dict:
        return {"update_phase": self.phase.value, "update_abandoned": self.abandoned}
