"""A gloo weight-transfer backend for vLLM, so that RL weight sync works on CPU.

vLLM's own backends (nccl, ipc) need an accelerator. This one takes the same
``init_info`` fields as vLLM's nccl backend and the same ``update_info``
fields, packs by the same rule, and loads through vLLM's layerwise-reload
lifecycle, so a trainer moves between CPU and GPU by changing the backend
name only.

One difference in timing: the rendezvous with the trainer runs on a thread.
vLLM runs worker calls inside the EngineCore's loop, so a blocking
rendezvous would stop the engine from serving until the trainer joins (or
never, if it does not). ``init_transfer_engine`` returns at once and
``status()`` reports how the rendezvous is going.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..weights.packing import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, dtype_from_name, plan_chunks, unpack
from .vllm_api import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

log = logging.getLogger("skyinfer.gloo_transfer")



@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    packed_num_buffers: int = 2  # accepted for nccl compatibility; gloo has no streams to overlap
    # Bounds the rendezvous and every later collective; the front sets it
    # (--weight-transfer-timeout, or the trainer's own init_info timeout_s).
    timeout_s: float


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # None: as agreed at init.
    packed: bool | None = field(default=None)

    def __post_init__(self):
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names, dtype_names and shapes must be as long as each other; "
                f"got {len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, dtype_from_name(d), tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group = None
        self._info: GlooWeightTransferInitInfo | None = None
        self._joining: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._join_timed_out = False
        self._attempt = 0

    # -- rendezvous ---------------------------------------------------------
    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        # A rendezvous still blocked in a connect (its trainer never came) cannot
        # be interrupted; a new one supersedes it and its outcome is dropped.
        self._attempt += 1
        self._info = init_info
        self._join_error = None
        self._join_timed_out = False
        # A worker's rank: its place in this engine (tp x pp), after the ranks before it.
        rank = init_info.rank_offset + self.parallel_config.rank
        self._joining = threading.Thread(
            target=self._join, args=(init_info, rank, self._attempt), daemon=True, name="gloo-rendezvous"
        )
        self._joining.start()

    def _join(self, info: GlooWeightTransferInitInfo, rank: int, attempt: int) -> None:
        from .vllm_api import stateless_init_torch_distributed_process_group

        started = time.monotonic()
        try:
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

    def status(self) -> dict:
        if self._joining is None:
            return {"state": "none"}
        if self._joining.is_alive():
            return {"state": "joining"}
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
    def start_weight_update(self) -> None:
        from .vllm_api import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        group = self._ready_group()
        assert self._info is not None
        metas = update_info.metas()
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

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has
        # nothing to do (and no accelerator to ask) on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        from .vllm_api import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _refresh_tied_lm_head(self.model, self.model_config)

    def shutdown(self) -> None:
        if self._group is not None:
            from .vllm_api import stateless_destroy_torch_distributed_process_group

            try:
                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception:  # a group whose peer died may not shut down cleanly
                log.warning("weight-transfer group did not shut down cleanly", exc_info=True)
            self._group = None


def _refresh_tied_lm_head(model: torch.nn.Module, model_config) -> None:
    """With tied embeddings the CPU lm_head keeps a packed copy of the old
    embedding after a reload; re-running its post-load step repacks it."""
    hf_config = getattr(model_config, "hf_config", None)
    lm_head = getattr(model, "lm_head", None)
    if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None:
        return
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(lm_head)
