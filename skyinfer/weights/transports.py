"""The front's side of each transport: which ``init_info`` and ``update_info`` it takes, what every
engine's own ``init_info`` is, and what it removes when an update ends. Bodies are checked with the
transport's models (transfer/protocol.py) before any engine sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

import attrs

from ..errors import UNKNOWN_LAYOUT, ApiError
from ..ranks import LayoutError, RankLayout
from ..transfer import GLOO, IPC, NCCL, SHM, Transport
from ..transfer.protocol import (
    GroupInitInfo,
    GroupUpdateInfo,
    IpcInitInfo,
    IpcUpdateInfo,
    SharedMemoryInitInfo,
    SharedMemoryUpdateInfo,
    TensorLayouts,
    UnknownLayout,
    UpdateMetadata,
    layout_fields,
    new_server_token,
    remove_segments,
    segment_path,
    segment_prefix,
    without_layout,
)
from ..transfer.rendezvous import wait_until_listening

# The server flag that lets vLLM's pickled IPC handles through.
PICKLED_IPC_FLAG = "--allow-pickled-ipc"


class TransferRefused(ApiError):
    """A weight-transfer body this server cannot take: 400 before any engine sees it."""


@attrs.frozen
class InitPlan:
    """What the engines are told at /init_weight_transfer, and what the trainer is answered."""

    # Each engine's own init_info, in engine order.
    engine_init_infos: list[dict]
    # How long the engines may take to be ready (the rendezvous, if any).
    timeout_s: float
    answer: dict
    # Where the trainer hosts the group's store (a rendezvous by address), which it must listen on
    # before any engine is asked to join.
    trainer_address: tuple[str, int] | None = None


def _wrong_transport(transport: Transport, given: str) -> TransferRefused:
    how = {
        GLOO: "engines on devices of their own receive over a gloo group: init_info needs master_address,"
        " master_port and world_size (GlooTrainer sends them)",
        NCCL: "engines on GPUs of their own receive over NCCL: init_info needs master_address and master_port"
        " (or nccl_unique_id_b64), and world_size",
        SHM: "this server is colocated (--colocate): its engines map the trainer's memory through shared memory,"
        " with no process group; init_info takes no rendezvous fields",
        IPC: "this server is colocated (--colocate): its engines map the trainer's GPU memory through CUDA IPC,"
        " with no process group; init_info takes only packed",
    }[transport]
    colocate = (
        " (start skyinfer with --colocate for a trainer that shares the engines' devices)" if transport.group else ""
    )
    return TransferRefused(f"init_info {given}: {how}; push with {transport.trainer}{colocate}", param="init_info")


class FrontTransport:
    def __init__(
        self, transport: Transport, workers_per_engine: tuple[int, ...], timeout_s: float, allow_pickled_ipc: bool
    ):
        self.transport = transport
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self.allow_pickled_ipc = allow_pickled_ipc
        # Shared-memory segments this server's trainers make begin with it.
        self.segment_prefix = segment_prefix(new_server_token())
        # The segment the trainer writes each push into, left in place between pushes that finish.
        self.reused_segment: str | None = None
        # The layouts trainers gave in full (a push may then name its own alone), and, by layout,
        # the engine processes (engine id, pid) that took a push of it: they are sent its id alone.
        self.layouts = TensorLayouts()
        self._engines_given: dict[str, set[tuple[int, int | None]]] = {}

    @property
    def shm_segment_prefix(self) -> str | None:
        """What this server's trainers' segments begin with: the shared-memory transport's, and the
        CUDA IPC transport's stand-in for its handles on CPU."""
        return self.segment_prefix if self.transport in (SHM, IPC) else None

    # -- init -------------------------------------------------------------------------
    async def plan_init(self, init_info: dict, workers_per_engine: tuple[int, ...]) -> InitPlan:
        """``workers_per_engine``: of the engines taking part (the fleet, in engine order)."""
        if self.transport.group:
            return await self._plan_group(init_info, workers_per_engine)
        rendezvous = {"master_address", "master_port", "nccl_unique_id_b64", "world_size"} & init_info.keys()
        if rendezvous:
            raise _wrong_transport(self.transport, f"has {', '.join(sorted(rendezvous))}")
        info = (SharedMemoryInitInfo if self.transport is SHM else IpcInitInfo).parse(init_info, ("init_info",))
        # What a trainer names its segments with (IPC's: where a CPU stands in for CUDA's handles).
        answer = {"transport": self.transport.name, "segment_prefix": self.segment_prefix}
        timeout_s = self.timeout_s if info.timeout_s is None else info.timeout_s
        engine_info = info.model_dump(exclude={"timeout_s"})
        return InitPlan([engine_info] * len(workers_per_engine), timeout_s, answer)

    async def _plan_group(self, init_info: dict, workers_per_engine: tuple[int, ...]) -> InitPlan:
        if init_info.keys() <= {"packed"}:
            raise _wrong_transport(self.transport, "has no rendezvous (vLLM's ipc backend sends this)")
        info = GroupInitInfo.parse(init_info, ("init_info",))
        if info.nccl_unique_id_b64 is not None and self.transport is not NCCL:
            raise _wrong_transport(self.transport, "has nccl_unique_id_b64, which only NCCL takes")
        try:
            layout = RankLayout.build(info.rank_offset, info.world_size, workers_per_engine)
        except LayoutError as exc:
            raise TransferRefused(str(exc), param="init_info.world_size") from None
        if info.master_address is not None:
            await _check_trainer_address(info)
        timeout_s = self.timeout_s if info.timeout_s is None else info.timeout_s
        fields = info.model_dump(exclude_none=True, exclude={"timeout_s"})
        # Every engine's receiver bounds its rendezvous and collectives with the group's timeout.
        engine_infos = [
            {**fields, "timeout_s": timeout_s, "rank_offset": layout.rank_offset(i)}
            for i in range(len(workers_per_engine))
        ]
        answer = {
            "transport": self.transport.name,
            "world_size": info.world_size,
            "rank_offsets": [e["rank_offset"] for e in engine_infos],
        }
        address = None if info.master_address is None else (info.master_address, info.master_port)
        return InitPlan(engine_infos, timeout_s, answer, address)

    async def trainer_listening(self, plan: InitPlan) -> None:
        """Return once the trainer listens at the group's address, within the group's timeout: engines
        asked to join before then would miss it (transfer/rendezvous.py says why). The looks run on a
        thread; cancelled, this returns at once, and the thread stops before its next look."""
        if plan.trainer_address is None:
            return
        host, port = plan.trainer_address
        deadline = time.monotonic() + plan.timeout_s
        given_up = threading.Event()
        try:
            await asyncio.to_thread(wait_until_listening, host, port, deadline, lambda: not given_up.is_set())
        except TimeoutError:
            raise TransferRefused(
                f"the trainer did not join the weight-transfer group within {plan.timeout_s:.0f}s: nothing"
                f" listened at {host}:{port}, and no engine was asked to join",
                status=504,
                param="init_info.master_address",
            ) from None
        finally:
            given_up.set()

    # -- updates ----------------------------------------------------------------------
    def parse_update(self, update_info: dict, *, carries_data: bool) -> UpdateMetadata:
        """The update's metadata, checked; with ``carries_data`` also what the transport moves
        the bytes with (a /start_weight_update names only the tensors). A layout given in full is
        kept; one named alone is read from those kept."""
        try:
            full = self.layouts.expand(update_info) if isinstance(update_info, dict) else update_info
        except UnknownLayout as exc:
            raise TransferRefused(str(exc), status=409, code=UNKNOWN_LAYOUT, param="update_info.layout") from None
        meta = self._parse_update(full, carries_data)
        self.layouts.given(meta)
        return meta

    def _parse_update(self, update_info: dict, carries_data: bool) -> UpdateMetadata:
        if not carries_data:
            return UpdateMetadata.parse(update_info, ("update_info",))
        if self.transport is SHM:
            meta = SharedMemoryUpdateInfo.parse(update_info, ("update_info",))
            try:
                meta.check_segment(self.segment_prefix)
            except ValueError as exc:
                raise TransferRefused(f"update_info.segment: {exc}", param="update_info.segment") from None
            return meta
        if self.transport is IPC:
            meta = IpcUpdateInfo.parse(update_info, ("update_info",))
            if meta.pickled and not self.allow_pickled_ipc:
                raise TransferRefused(
                    "update_info.ipc_handles_pickled: this server does not unpickle what comes over HTTP; send"
                    f" skyinfer's JSON handles (IPCTrainer), or start it with {PICKLED_IPC_FLAG} to take vLLM's"
                    " pickled ones",
                    param="update_info.ipc_handles_pickled",
                )
            return meta
        return GroupUpdateInfo.parse(update_info, ("update_info",))

    def for_engines(self, update_info: dict, meta: UpdateMetadata, records) -> dict:
        """The update_info the engines are sent: naming its layout alone where every one of them took
        a push of it (their workers keep it), else in full."""
        if meta.layout is None:
            return update_info
        given = self._engines_given.get(meta.layout, set())
        if all((r.engine_id, r.pid) in given for r in records):
            return {**without_layout(update_info), "layout": meta.layout}
        return {**update_info, **layout_fields(meta)}

    def engines_took(self, meta: UpdateMetadata, records) -> None:
        """``records`` took a push of ``meta``'s layout: its id alone is enough for them from now on."""
        if meta.layout is None:
            return
        # Only for the layouts kept here: an engine's workers keep as many, and see no layout this side has not.
        self._engines_given = {layout: e for layout, e in self._engines_given.items() if layout in self.layouts}
        self._engines_given.setdefault(meta.layout, set()).update((r.engine_id, r.pid) for r in records)

    def update_sent(self, meta: UpdateMetadata) -> None:
        """An /update_weights call ended, however: the engines hold what they still read from a
        segment (mapped), so its name goes now, unless the trainer reuses it (an IPC trainer's packed
        buffer, where a CPU's segment stands in for it, too)."""
        if isinstance(meta, IpcUpdateInfo) and meta.reuse:
            self.reused_segment = meta.host_segment()
            return
        if not isinstance(meta, SharedMemoryUpdateInfo):
            return
        if meta.reuse:
            self.reused_segment = meta.segment
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(meta.segment))

    def update_ended(self, finished: bool = False) -> list[str]:
        """An update ended: whatever segments its trainer left go too, but for the one it reuses
        after a push that ``finished`` (one aborted or abandoned may have lost its trainer)."""
        if self.transport not in (SHM, IPC):
            return []
        if not finished:
            self.reused_segment = None
        return remove_segments(self.segment_prefix, keep=self.reused_segment)


async def _check_trainer_address(info: GroupInitInfo) -> None:
    """A trainer address that does not resolve is a 400 now, not a rendezvous timeout later."""
    try:
        await asyncio.get_running_loop().getaddrinfo(info.master_address, info.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise TransferRefused(
            f"init_info master_address {info.master_address!r} does not resolve: {exc}",
            param="init_info.master_address",
        ) from None
