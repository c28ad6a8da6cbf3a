"""The trainer's side of weight sync: join skyinfer's transfer group, push named tensors or a LoRA adapter.

Needs torch and skyinfer's HTTP client, never vLLM::

    from skyinfer.trainer import GlooTrainer

    trainer = GlooTrainer("http://127.0.0.1:8000")
    trainer.init()                                   # once: joins every engine's workers
    trainer.push(model.state_dict().items(), version="step-17")
    # or, for a LoRA policy (peft), the adapter alone:
    trainer.push_adapter("policy", get_peft_model_state_dict(peft_model).items(), lora_config, version="step-17")

``push`` runs the broadcast while the HTTP call that makes the engines
receive is in flight (both are halves of one collective). Three HTTP calls
per push, however many tensors: start (checks the metadata before any byte
moves), update, finish. The HTTP side is ``skyinfer.client.Client``, which
also satisfies vLLM's ``VLLMWeightSyncClient`` protocol, so vLLM's own
trainer-side nccl engine (on GPUs) can drive skyinfer unchanged. The
other way round works too: ``GlooTrainer(url, sync_client=...)`` makes a
push's calls through any client of that protocol (vLLM's
``HTTPVLLMWeightSyncClient``, say), in the protocol's shape.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from .client import Client, SkyinferError
from .weights.packing import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, dtype_name, pack, plan_chunks


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


class GlooTrainer:
    """Rank 0 of a gloo weight-transfer group spanning every engine of a skyinfer server."""

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
        # A client of vLLM's VLLMWeightSyncClient protocol to make the push's four calls instead.
        sync_client: object | None = None,
    ):
        self.client = client or Client(base_url, admin_key=admin_key, timeout_s=timeout_s + 60)
        self._calls = self.client if sync_client is None else _ProtocolCalls(sync_client)
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.packed = packed
        self.buffer_size_bytes = buffer_size_bytes
        self.rank_offset = rank_offset
        self.world_size = world_size
        self._store = None
        self._group = None

    def init(self) -> None:
        """Form the group with every engine; returns once all have joined."""
        world_size = self.world_size or self.rank_offset + self.client.get_world_size()
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

    def close(self) -> None:
        """Close the HTTP connections; the group ends with this object."""
        self.client.close()

    def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, one_call: bool = False, verify: bool = False
    ) -> None:
        """Send the tensors to every engine; afterwards they serve ``version``.

        ``one_call`` uses a single ``/update_weights`` (skyinfer starts and
        finishes the update itself): one HTTP call instead of three.
        ``verify`` has the engines' weights checked against each other at the
        finish: one that differs is held out and the push raises.
        """
        if one_call and verify:
            raise ValueError("verify needs the finish call: push with one_call=False")
        tensors, metas, update_info = self._prepare(named_tensors)
        if not one_call:
            self._calls.start_weight_update(update_info)  # a 400 here: nothing moved
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(self._calls.update_weights, update_info, version if one_call else None)
            if one_call:
                _raise_if_refused(receiving)
            self._broadcast(tensors, metas)
            receiving.result()
        if not one_call:
            self._calls.finish_weight_update(version, verify)

    def push_adapter(
        self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], peft_config, version: str
    ) -> None:
        """Send a LoRA adapter to every engine, which then serves it as ``lora_name`` at ``version``
        (replacing the version it served). ``named_tensors``: PEFT's names, as
        ``peft.get_peft_model_state_dict`` gives them; ``peft_config``: its ``LoraConfig`` or that as a
        dict. Nothing is written to a disk the trainer and the server share."""
        tensors, metas, update_info = self._prepare(named_tensors)
        config = _json_ready(peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config))
        # Checked first (bad shapes, no group: a refusal, and nothing moves), so that the
        # broadcast below never waits on engines that will not receive.
        self.client.update_lora_adapter(lora_name, config, update_info, version, check_only=True)
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(self.client.update_lora_adapter, lora_name, config, update_info, version)
            self._broadcast(tensors, metas)
            receiving.result()

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """The tensors as they are sent, their metadata, and vLLM's ``update_info`` for them."""
        if self._group is None:
            raise RuntimeError("call init() first")
        tensors = [(name, t.detach().contiguous().cpu()) for name, t in named_tensors]
        metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors]
        update_info = {
            "names": [m.name for m in metas],
            "dtype_names": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas],
            "packed": self.packed,
        }
        return tensors, metas, update_info

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> None:
        if self.packed:
            by_name = dict(tensors)
            for chunk in plan_chunks(metas, self.buffer_size_bytes):
                self._send(pack([by_name[m.name] for m in chunk]))
        else:
            for _name, tensor in tensors:
                self._send(tensor)

    def _send(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([tensor], opts).wait()


class _ProtocolCalls:
    """A push's calls made through a client of vLLM's ``VLLMWeightSyncClient`` protocol, whose
    start carries no metadata (the front then checks it at the update) and whose finish has no verify."""

    def __init__(self, client):
        self._client = client

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._client.init_weight_transfer_engine(init_info)

    def start_weight_update(self, _update_info: dict) -> None:
        self._client.start_weight_update()

    def update_weights(self, update_info: dict, weight_version: str | None) -> None:
        if weight_version is not None:
            raise ValueError("a one-call push needs skyinfer's client: vLLM's update_weights takes no version")
        self._client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str, verify: bool) -> None:
        if verify:
            raise ValueError("a verified push needs skyinfer's client: vLLM's protocol has no verify")
        self._client.finish_weight_update(weight_version)


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
