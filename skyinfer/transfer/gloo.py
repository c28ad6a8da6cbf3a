"""Weights over a gloo process group, for engines on separate devices on CPU: both sides.

The engines' side is a weight-transfer backend for vLLM (``skyinfer_gloo``), since vLLM's own
(nccl, ipc) need an accelerator. It takes the same ``init_info`` fields as vLLM's nccl backend
and the same ``update_info`` fields, packs by the same rule, and loads through vLLM's
layerwise-reload lifecycle, so a trainer moves between CPU and GPU by changing the backend only.
The trainer's side is ``GlooTrainer``: rank 0 of a group spanning every engine's workers, built
the way vLLM builds its members' groups. It needs torch, never vLLM::

    trainer = GlooTrainer("http://127.0.0.1:8000")
    trainer.init()                                   # once: joins every engine's workers
    trainer.push(model.state_dict().items(), version="step-17")
    # or, for a LoRA policy (peft), the adapter alone:
    trainer.push_adapter("policy", get_peft_model_state_dict(peft_model).items(), lora_config, version="step-17")

One difference in timing from vLLM's nccl backend: the engine side's rendezvous runs on a
thread. vLLM runs worker calls inside the EngineCore's loop, so a blocking rendezvous would stop
the engine from serving until the trainer joins (or never, if it does not):
``init_transfer_engine`` returns at once and ``status()`` reports how the rendezvous is going.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from ..client import Client, SkyinferError
from ..ranks import worker_index
from .packing import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, dtype_from_name, pack, plan_chunks, unpack
from .protocol import GroupInitInfo, GroupUpdateInfo
from .pushing import NamedTensors, OneCall, Trainer, tensor_list, update_weights_call
from .receiving import LayerwiseReceiver
from .rendezvous import wait_until_listening

log = logging.getLogger("skyinfer.transfer.gloo")


def _metas(info: GroupUpdateInfo) -> list[TensorMeta]:
    return [TensorMeta(n, dtype_from_name(d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]


# -- the trainer's side ---------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _gloo_group(host: str, port: int, world_size: int, timeout: timedelta):
    """Rank 0 of a gloo group, built the way vLLM's ``stateless_init_torch_distributed_process_group``
    builds its members' (same store prefix, same sequence-number handshake)."""
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    prefix_store = dist.PrefixStore(f"tcp://{host}:{port}", store)
    group = dist.ProcessGroup(prefix_store, 0, world_size)
    backend = dist.ProcessGroupGloo(prefix_store, 0, world_size, timeout=timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return store, group


class GlooTrainer(Trainer):
    """Rank 0 of a gloo weight-transfer group spanning every engine of a skyinfer server (or of
    several: one URL per node). ``push`` broadcasts while the HTTP call that makes the engines
    receive is in flight: both are halves of one collective."""

    def __init__(
        self,
        # One skyinfer server, or one per node: the group then spans every node's engines.
        base_url: str | Sequence[str],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout_s: float = 120.0,
        # Measured on CPU (tools/bench_weight_sync.py): one broadcast per tensor
        # beats packing, which only adds copies when nothing overlaps them.
        packed: bool = False,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        rank_offset: int = 1,
        world_size: int | None = None,
        admin_key: str | None = None,
        client: Client | None = None,
        sync_client: object | None = None,
    ):
        super().__init__(base_url, admin_key=admin_key, timeout_s=timeout_s, client=client, sync_client=sync_client)
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.buffer_size_bytes = buffer_size_bytes
        self.rank_offset = rank_offset
        # The caller's, if given; else the server's workers after rank_offset, asked at each init.
        self._requested_world_size = world_size
        self.world_size = world_size
        self._store = None
        self._group = None

    def init(self) -> None:
        """Form the group with every engine; returns once all have joined."""
        world_size = self._requested_world_size or self.rank_offset + self.client.get_world_size()
        port = self.master_port or _free_port(self.master_address)
        init_info = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": self.rank_offset,
            "world_size": world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.buffer_size_bytes,
            "timeout_s": self.timeout_s,
        }
        timeout = timedelta(seconds=self.timeout_s)
        pool = ThreadPoolExecutor(2)
        try:
            # The engines' workers connect to the store this side hosts; building
            # the gloo group waits until all of them have. A refusal from the
            # server means they never will: report it, don't wait out the timeout.
            joined = pool.submit(self._calls.init_weight_transfer_engine, init_info)
            grouped = pool.submit(_gloo_group, self.master_address, port, world_size, timeout)
            joined.result()
            # The group needs its store alive: this side hosts it for every rank.
            self._store, self._group = grouped.result()
        finally:
            pool.shutdown(wait=False)
        self.world_size = world_size

    def push_adapter(self, lora_name: str, named_tensors: NamedTensors, peft_config, version: str) -> None:
        """Send a LoRA adapter to every engine, which then serves it as ``lora_name`` at ``version``
        (replacing the version it served). ``named_tensors``: PEFT's names, as
        ``peft.get_peft_model_state_dict`` gives them; ``peft_config``: its ``LoraConfig`` or that as a
        dict. Nothing is written to a disk the trainer and the server share."""
        tensors = self._prepare(named_tensors)
        update_info = {**tensor_list(tensors), "packed": self.packed}
        config = _json_ready(peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config))

        def send() -> None:
            # Checked first (bad shapes, no group: a refusal, and nothing moves), so that the
            # broadcast below never waits on engines that will not receive.
            self.client.update_lora_adapter(lora_name, config, update_info, version, check_only=True)
            with ThreadPoolExecutor(1) as pool:
                receiving = pool.submit(self.client.update_lora_adapter, lora_name, config, update_info, version)
                self._broadcast(tensors)
                receiving.result()

        self._in_group(send)

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        if self._group is None:
            raise RuntimeError("call init() first")
        return [(name, t.detach().contiguous().cpu()) for name, t in named_tensors]

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(update_weights_call, self._calls, {**metadata, "packed": self.packed}, one_call)
            if one_call is not None:
                _raise_if_refused(receiving)
            self._broadcast(tensors)
            receiving.result()

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.packed:
            by_name = dict(tensors)
            for chunk in plan_chunks(
                [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors], self.buffer_size_bytes
            ):
                self._send_one(pack([by_name[m.name] for m in chunk]))
        else:
            for _name, tensor in tensors:
                self._send_one(tensor)

    def _send_one(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([tensor], opts).wait()


def _json_ready(value):
    """A PEFT config as JSON can carry it (PEFT keeps target modules as a set)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_ready(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# How long a one-call push waits for the server to refuse its metadata before
# broadcasting. The front checks metadata first thing, so a refusal is back
# in milliseconds; a call still pending after this is receiving.
_REFUSAL_GRACE_S = 0.5


def _raise_if_refused(receiving: Future) -> None:
    done = threading.Event()
    receiving.add_done_callback(lambda _f: done.set())
    if done.wait(_REFUSAL_GRACE_S):
        receiving.result()  # raises the refusal
        raise SkyinferError(500, "the server finished an update before any byte was sent")


# -- the engines' side ----------------------------------------------------------------


class GlooReceiver(LayerwiseReceiver):
    """vLLM's weight-transfer backend interface, for gloo (receiving.py: how it joins vLLM)."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group = None
        self._info: GroupInitInfo | None = None
        self._joining: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._join_timed_out = False
        self._attempt = 0
        # The trainer's address while this worker waits for it to listen.
        self._waiting_for: str | None = None

    # -- rendezvous ---------------------------------------------------------
    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        if init_info.master_address is None or init_info.timeout_s is None:
            raise ValueError("the gloo backend needs master_address, master_port and timeout_s")
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
            target=self._join, args=(init_info, rank, self._attempt), daemon=True, name="gloo-rendezvous"
        )
        self._joining.start()

    def _join(self, info: GroupInitInfo, rank: int, attempt: int) -> None:
        from ..vllm_api import stateless_init_torch_distributed_process_group

        started = time.monotonic()
        try:
            self._wait_for_trainer(info, started + info.timeout_s, attempt)
            group = stateless_init_torch_distributed_process_group(
                info.master_address,
                info.master_port,
                rank,
                info.world_size,
                backend="gloo",
                timeout=timedelta(seconds=info.timeout_s),
            )
        except BaseException as exc:  # reported through status()
            if attempt == self._attempt:
                self._join_error = exc
                # Nobody to meet until the time ran out: the trainer never came.
                self._join_timed_out = time.monotonic() - started >= 0.9 * info.timeout_s
            return
        if attempt == self._attempt:
            self._group = group
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

    def _ready_group(self):
        if self._joining is None or self._info is None:
            raise RuntimeError("weight transfer not initialized; call init_weight_transfer_engine first")
        self._joining.join(self._info.timeout_s)
        if self._group is None:
            raise RuntimeError(f"no weight-transfer group: {self.status()}")
        return self._group

    # -- one update -----------------------------------------------------------
    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        group = self._ready_group()
        assert self._info is not None
        metas = _metas(update_info)
        packed = self._info.packed if update_info.packed is None else update_info.packed
        if packed:
            for chunk in plan_chunks(metas, self._info.packed_buffer_size_bytes):
                buffer = torch.empty(sum(m.nbytes for m in chunk), dtype=torch.uint8)
                group.broadcast(buffer, 0).wait()
                self.model.load_weights(unpack(buffer, chunk))
        else:
            for meta in metas:
                tensor = torch.empty(meta.shape, dtype=meta.dtype)
                group.broadcast(tensor, 0).wait()
                self.model.load_weights([(meta.name, tensor)])

    def shutdown(self) -> None:
        if self._group is not None:
            from ..vllm_api import stateless_destroy_torch_distributed_process_group

            try:
                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception:  # a group whose peer died may not shut down cleanly
                log.warning("weight-transfer group did not shut down cleanly", exc_info=True)
            self._group = None
