"""The engines' side of a process-group transport (gloo, NCCL): the rendezvous on a thread, then
each update received by broadcasts from the trainer (rank 0), packed or one tensor at a time, by
vLLM's rule (``packing``), and loaded through the layerwise reload (``receiving``).

A transport gives two things: how a worker joins its group (``_open``), and the communicator it
receives with: anything with ``broadcast(tensor, src, stream)`` and ``destroy()``, as vLLM's
``PyNcclCommunicator`` has. Everything else, the same on every device, is here.

One difference in timing from vLLM's nccl backend: the rendezvous runs on a thread. vLLM runs
worker calls inside the EngineCore's loop, so a blocking rendezvous would stop the engine from
serving until the trainer joins (or never, if it does not): ``init_transfer_engine`` returns at
once and ``status()`` reports how the rendezvous is going.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Protocol

import torch

from ..ranks import worker_index
from .delta import delta_pieces, unpack_sparse
from .packing import TensorMeta, dtype_from_name, plan_chunks, unpack
from .protocol import GroupInitInfo, GroupUpdateInfo
from .receiving import LiveReceiver, bind_thread, wait_for
from .rendezvous import wait_until_listening

__all__ = ["Communicator", "GroupReceiver"]

log = logging.getLogger("skyinfer.transfer.collective")


class Communicator(Protocol):
    """What a worker receives with: vLLM's ``PyNcclCommunicator``'s calls."""

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None: ...

    def destroy(self) -> None: ...


# How many reused buffers the receiving thread may fill ahead of the loads, and how often a thread
# blocked on the other side checks whether the update was given up.
_AHEAD = 1
_POLL_S = 0.1


class _Stopped(Exception):
    """The update's loads gave up: its receiving thread ends."""


def _until_stopped(stop: threading.Event, call):
    """``call()`` (a queue's get or put with a timeout) tried until it succeeds or ``stop`` is set."""
    while not stop.is_set():
        try:
            return call()
        except (queue.Empty, queue.Full):
            continue
    raise _Stopped


def _metas(info: GroupUpdateInfo) -> list[TensorMeta]:
    return [TensorMeta(n, dtype_from_name(d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]


class GroupReceiver(LiveReceiver):
    """vLLM's weight-transfer backend interface over a process group (receiving.py: how it joins vLLM)."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._communicator: Communicator | None = None
        self._info: GroupInitInfo | None = None
        self._joining: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._join_timed_out = False
        self._attempt = 0
        # The trainer's address while this worker waits for it to listen.
        self._waiting_for: str | None = None

    def _open(self, info: GroupInitInfo, rank: int) -> Communicator:
        """Join the group as ``rank`` (blocking until every rank has): the transport's own."""
        raise NotImplementedError

    def _stream(self):
        """The stream a broadcast runs on: the worker's current CUDA stream (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    # -- rendezvous ---------------------------------------------------------
    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        if init_info.timeout_s is None:
            raise ValueError("a process-group backend needs timeout_s (the front sends the server's)")
        self.shutdown()
        # A rendezvous still blocked in a connect (its trainer never came) cannot
        # be interrupted; a new one supersedes it and its outcome is dropped.
        self._attempt += 1
        self._info = init_info
        self._join_error = None
        self._join_timed_out = False
        # A worker's rank: its place in this engine (tp x pp x dp), after the ranks before it.
        rank = init_info.rank_offset + worker_index(self.parallel_config)
        self._joining = threading.Thread(
            target=self._join, args=(init_info, rank, self._attempt), daemon=True, name="group-rendezvous"
        )
        self._joining.start()

    def _join(self, info: GroupInitInfo, rank: int, attempt: int) -> None:
        started = time.monotonic()
        try:
            if info.master_address is not None:
                self._wait_for_trainer(info, started + info.timeout_s, attempt)
            communicator = self._open(info, rank)
        except BaseException as exc:  # reported through status()
            if attempt == self._attempt:
                self._join_error = exc
                # Nobody to meet until the time ran out: the trainer never came.
                self._join_timed_out = time.monotonic() - started >= 0.9 * info.timeout_s
            return
        if attempt == self._attempt:
            self._communicator = communicator
            log.info("joined the weight-transfer group as rank %d of %d", rank, info.world_size)

    def _wait_for_trainer(self, info: GroupInitInfo, deadline: float, attempt: int) -> None:
        """Connect to the trainer's store only once it listens (rendezvous.py says why); the front
        waits for the same before asking, so this covers a trainer that restarted since."""
        self._waiting_for = f"{info.master_address}:{info.master_port}"
        try:
            # Wanted until a newer init supersedes this one.
            if not wait_until_listening(
                info.master_address, info.master_port, deadline, lambda: attempt == self._attempt
            ):
                raise RuntimeError("superseded by a newer init")
        finally:
            self._waiting_for = None

    def status(self) -> dict:
        if self._joining is None:
            return {"state": "none"}
        if self._joining.is_alive():
            waiting_for = self._waiting_for
            return {"state": "joining", **({"waiting_for": waiting_for} if waiting_for else {})}
        if self._join_error is not None:
            state = "timeout" if self._join_timed_out else "failed"
            return {"state": state, "error": f"{type(self._join_error).__name__}: {self._join_error}"}
        return {"state": "ready"}

    def _ready_communicator(self) -> Communicator:
        if self._joining is None or self._info is None:
            raise RuntimeError("weight transfer not initialized; call init_weight_transfer_engine first")
        self._joining.join(self._info.timeout_s)
        if self._communicator is None:
            raise RuntimeError(f"no weight-transfer group: {self.status()}")
        return self._communicator

    # -- one update -----------------------------------------------------------
    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        """Each broadcast received on a thread of its own (``_received``) while the ones before it
        are loaded here: the wire and the loads overlap."""
        communicator = self._ready_communicator()
        assert self._info is not None
        metas = _metas(update_info)
        packed = self._info.packed if update_info.packed is None else update_info.packed
        delta = update_info.delta
        if delta is not None:
            if not packed:
                raise ValueError("a delta push is packed; this group was set up unpacked")
            # Its pieces, in the order sent (delta.py); sparse ones by tensor: (changed elements, meta).
            sparse = {m.name: (count, m) for m, count in zip(metas, delta.changed) if count > 0}
            metas = delta_pieces(metas, delta.changed)
        chunks = list(plan_chunks(metas, self._info.packed_buffer_size_bytes)) if packed else [[m] for m in metas]
        if not chunks:  # a delta of nothing changed: nothing is broadcast
            return
        for chunk, buffer in self._received(communicator, chunks, packed):
            if delta is None:
                self.load(unpack(buffer, chunk) if packed else [(chunk[0].name, buffer)])
                continue
            pieces = unpack(buffer, chunk)
            if dense := [(name, piece) for name, piece in pieces if name not in sparse]:
                self.load(dense)
            for name, piece in pieces:
                if name in sparse:
                    count, meta = sparse[name]
                    self.load_delta(meta, *unpack_sparse(piece, count, meta.dtype))

    def _received(self, communicator: Communicator, chunks: list[list[TensorMeta]], packed: bool):
        """Each chunk and the buffer it was received into, in order, the broadcasts made on a thread
        ahead of the caller. Packed chunks go into ``_AHEAD + 1`` buffers (vLLM's packed receive
        keeps two), reused while the update loads at once (its loads copy what they are given
        before they return); else each into a buffer of its own, which a load may keep."""
        ready: queue.Queue = queue.Queue(maxsize=1)
        reusable: queue.Queue = queue.Queue()
        if packed and self.loads_at_once:
            size = max(sum(m.nbytes for m in chunk) for chunk in chunks)
            for _ in range(min(_AHEAD + 1, len(chunks))):
                reusable.put(torch.empty(size, dtype=torch.uint8, device=self.device))
        stop = threading.Event()

        def buffers_for(chunk: list[TensorMeta]) -> tuple[torch.Tensor | None, torch.Tensor]:
            """A reusable buffer (or None) and the part of it, or the new buffer, the chunk goes into."""
            if not packed:
                return None, torch.empty(chunk[0].shape, dtype=chunk[0].dtype, device=self.device)
            nbytes = sum(m.nbytes for m in chunk)
            if not self.loads_at_once:
                return None, torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            whole = _until_stopped(stop, lambda: reusable.get(timeout=_POLL_S))
            return whole, whole[:nbytes]

        def receive() -> None:
            try:
                if self.device.type == "cuda":
                    bind_thread(self.device)
                for chunk in chunks:
                    whole, buffer = buffers_for(chunk)
                    communicator.broadcast(buffer, 0, self._stream())
                    if self.device.type == "cuda":
                        wait_for(self.device)
                    _until_stopped(stop, lambda item=(whole, buffer): ready.put(item, timeout=_POLL_S))
            except _Stopped:
                pass
            except BaseException as exc:  # the caller raises it
                failure = exc
                with contextlib.suppress(_Stopped):
                    _until_stopped(stop, lambda: ready.put(failure, timeout=_POLL_S))

        thread = threading.Thread(target=receive, daemon=True, name="skyinfer-receive")
        thread.start()
        try:
            for chunk in chunks:
                received = ready.get()
                if isinstance(received, BaseException):
                    raise received
                whole, buffer = received
                yield chunk, buffer
                if whole is not None:
                    if self.device.type == "cuda":
                        wait_for(self.device)  # the loads read it before it is received into again
                    reusable.put(whole)
            thread.join()
        finally:
            # A load that failed leaves the thread to end: at its next chunk, or when the group's
            # timeout ends the broadcast it waits in (the front aborts the update meanwhile).
            stop.set()

    def shutdown(self) -> None:
        if self._communicator is not None:
            try:
                self._communicator.destroy()
            except Exception:  # a group whose peer died may not shut down cleanly
                log.warning("weight-transfer group did not shut down cleanly", exc_info=True)
            self._communicator = None
