"""Weights over a gloo process group, for engines on separate devices on CPU: both sides.

The engines' side is a weight-transfer backend for vLLM (``skyinfer_gloo``), since NCCL and CUDA
IPC need an accelerator. It takes the same ``init_info`` fields as vLLM's nccl backend
and the same ``update_info`` fields, packs by the same rule, and loads through vLLM's
layerwise-reload lifecycle, so a trainer moves between CPU and GPU by changing the backend only.
The trainer's side is ``GlooTrainer``: rank 0 of a group spanning every engine's workers, built
the way vLLM builds its members' groups. It needs torch, never vLLM::

    trainer = GlooTrainer("http://127.0.0.1:8000")
    trainer.init()                                   # once: joins every engine's workers
    trainer.push(model.state_dict().items(), version="step-17")
    # or, for a LoRA policy (peft), the adapter alone:
    trainer.push_adapter("policy", get_peft_model_state_dict(peft_model).items(), lora_config, version="step-17")

The engines' side receives as every process-group transport does (``collective``); only how a
worker joins the group is gloo's.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from ..client import Client, SkyinferError
from ..errors import DELTA_BASE_MISMATCH, DELTA_NOT_APPLICABLE
from .collective import GroupReceiver
from .delta import SentWeights
from .packing import GLOO_BUCKET_BYTES, TensorMeta, pack_into, plan_chunks
from .protocol import GroupInitInfo
from .pushing import NamedTensors, OneCall, Trainer, tensor_list

log = logging.getLogger("skyinfer.trainer")

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
        # Buckets (vLLM's packed transfer): one broadcast and one load per bucket, each engine
        # receiving the next while it loads one, this side packing the next while one is on the
        # wire. Measured on CPU (tools/bench_weight_sync.py), against one broadcast per tensor:
        # the 352 MiB model's push 0.62 s against 0.76 s, the demo model's 0.031 s against 0.046 s.
        packed: bool = True,
        buffer_size_bytes: int = GLOO_BUCKET_BYTES,
        # Each push after the first sends only the elements that changed since the last one every
        # engine took (transfer/delta.py), diffed against a copy of it kept here (as much host
        # memory again as the weights); False: every push whole. Packed pushes only.
        delta: bool = True,
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
        # (vLLM's sync clients have no check_only, which a delta's push asks first.)
        self.delta = delta and packed and sync_client is None
        self._sent = SentWeights()
        # The delta the last send carried (None: it went whole).
        self._delta_sent = None
        self.rank_offset = rank_offset
        # The caller's, if given; else the server's workers after rank_offset, asked at each init.
        self._requested_world_size = world_size
        self.world_size = world_size
        self._store = None
        self._group = None
        self._bucket_buffers: list[torch.Tensor] = []

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
            # broadcast below does not wait on engines that will not receive (short of a change
            # between the two calls).
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
        update_info = {**metadata, "packed": self.packed}
        if self.delta:  # engines that cannot read their layers back keep a copy of this push for the next delta
            update_info["keep_for_deltas"] = True
        # What the server would refuse the call for is asked first: a refusal raises here, and no
        # broadcast waits on engines that will not receive. (A chunk of an open update was checked
        # at its start, but for a delta's base, which only the call itself names.)
        delta = self._sent.diff(tensors) if self.delta and not self._whole_push else None
        self._delta_sent = None
        if delta is not None:
            try:
                self._update_weights({**update_info, "delta": delta.update_info()}, one_call, check_only=True)
                update_info, tensors = {**update_info, "delta": delta.update_info()}, delta.pieces
                self._delta_sent = delta
            except SkyinferError as exc:
                if exc.code not in (DELTA_BASE_MISMATCH, DELTA_NOT_APPLICABLE):
                    raise
                log.info("the server takes this push whole: %s", exc.message)
                self._sent.forget()  # this push goes whole, and is the next one's base
                self.delta = exc.code == DELTA_BASE_MISMATCH  # else this server's engines take no delta
                if not self.delta:
                    del update_info["keep_for_deltas"]
                delta = None
        if delta is None and one_call is not None:
            self._update_weights(update_info, one_call, check_only=True)
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(self._update_weights, update_info, one_call)
            self._broadcast(tensors)
            receiving.result()

    def _took(self, tensors: list[tuple[str, torch.Tensor]], version: str) -> None:
        if self.delta:
            self._sent.took(tensors, version, self._delta_sent)

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self.packed:
            for _name, tensor in tensors:
                self._start_broadcast(tensor).wait()
            return
        if not tensors:
            return
        by_name = dict(tensors)
        chunks = list(plan_chunks([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors], self.buffer_size_bytes))
        buffers = self._buckets(max(sum(m.nbytes for m in chunk) for chunk in chunks), min(2, len(chunks)))
        # A bucket is packed while the one before it is on the wire; its buffer is packed into
        # again once its own broadcast ended.
        in_flight: list = [None] * len(buffers)
        try:
            for i, chunk in enumerate(chunks):
                slot = i % len(buffers)
                if in_flight[slot] is not None:
                    in_flight[slot].wait()
                    in_flight[slot] = None
                bucket = pack_into(buffers[slot], [by_name[m.name] for m in chunk])
                in_flight[slot] = self._start_broadcast(bucket)
        except BaseException:
            # The group broke: the other broadcast ends too (no buffer is written under it).
            for work in in_flight:
                if work is not None:
                    with contextlib.suppress(Exception):
                        work.wait()
            raise
        for work in in_flight:
            if work is not None:
                work.wait()

    def _buckets(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """``count`` buffers of at least ``nbytes``, made once and kept for the pushes that fit them:
        a fresh buffer's pages cost the kernel's allocation at every push."""
        if len(self._bucket_buffers) < count or self._bucket_buffers[0].numel() < nbytes:
            self._bucket_buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
        return self._bucket_buffers[:count]

    def _start_broadcast(self, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._group.broadcast([tensor], opts)


def _json_ready(value):
    """A PEFT config as JSON can carry it (PEFT keeps target modules as a set)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_ready(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# -- the engines' side ----------------------------------------------------------------


class _GlooGroup:
    """A gloo process group as a communicator (collective.py): ``PyNcclCommunicator``'s calls."""

    def __init__(self, group) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self.group.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        from ..vllm_api import stateless_destroy_torch_distributed_process_group

        stateless_destroy_torch_distributed_process_group(self.group)


class GlooReceiver(GroupReceiver):
    """A gloo group with the trainer, joined as vLLM joins its members' (``GlooTrainer`` hosts it)."""

    def _open(self, info: GroupInitInfo, rank: int) -> _GlooGroup:
        if info.master_address is None:
            raise ValueError("the gloo backend needs master_address and master_port (gloo has no NCCL unique id)")
        from ..vllm_api import stateless_init_torch_distributed_process_group

        group = stateless_init_torch_distributed_process_group(
            info.master_address,
            info.master_port,
            rank,
            info.world_size,
            backend="gloo",
            timeout=timedelta(seconds=info.timeout_s),
        )
        return _GlooGroup(group)
