"""skyinfer's vLLM worker extension (``--worker-extension-cls``): the worker calls the front needs
beyond vLLM's own. vLLM imports this module in every worker before the model loads: importing it
registers skyinfer's weight-transfer backends (``backends``) and sets a CPU worker up (``cpu_setup``)."""

from __future__ import annotations

import os
import time

import torch
from safetensors.torch import save_file

from ..devices import give_back_freed_memory
from ..engine_wire import ADAPTER_WEIGHTS_FILE, STAGED_SWAP_ENV, WORKER_SPIN_ENV
from ..ranks import worker_index
from ..transfer.receiving import pack_cpu_gemms
from . import backends  # noqa: F401 - registers skyinfer's backends with vLLM's factory
from .catchup_files import catch_up_file, export_tensors, import_tensors, served_tensors
from .cpu_setup import (
    compute_cpu_int8_exactly,
    keep_cpu_gemm_weights,
    keep_cpu_int8_scales,
    request_amx_permission,
    spin_briefly_after_reads,
)
from .staging import StagedPush
from .targets import CopyTarget, ShadowTarget
from .worker_calls import StepFailed, answers_every_rank

__all__ = ["SkyinferWorkerExtension"]

request_amx_permission()
keep_cpu_gemm_weights()
keep_cpu_int8_scales()
compute_cpu_int8_exactly()
if (spin_s := os.environ.get(WORKER_SPIN_ENV)) is not None:
    spin_briefly_after_reads(float(spin_s))


def _raise_kept_failure(receiver) -> None:
    """Raise what the last chunk, or the finish, of a weight update raised on this worker (the
    receivers keep it rather than raise it through vLLM's executor: worker_calls.py)."""
    failure, receiver.update_failure = receiver.update_failure, None
    if failure is not None:
        raise failure


def _forget_base(worker) -> None:
    """The live weights are about to be written outside an update: a copy kept for deltas no
    longer holds them (receiving.py; vLLM's own backends keep none)."""
    forget = getattr(getattr(worker, "weight_transfer_engine", None), "forget_base", None)
    if forget is not None:
        forget()


class SkyinferWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def skyinfer_transfer_status(self) -> dict:
        """How this worker's rendezvous with the trainer is going."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return {"state": "unconfigured"}
        status = getattr(engine, "status", None)
        if status is not None:
            return status()
        # vLLM's own backends join inside init_weight_transfer_engine, and the colocated ones
        # need no rendezvous: by the time this call is served, there is none under way.
        return {"state": "ready"}

    @answers_every_rank
    def skyinfer_update_outcome(self) -> dict | None:
        """Raise what the last chunk, or the finish, of a weight update raised on this worker, if
        anything; else how the update last finished was applied (receiving.py), None before then."""
        _raise_kept_failure(self.weight_transfer_engine)
        return self.weight_transfer_engine.last_applied

    @answers_every_rank
    def skyinfer_push(self, update_info: dict | list[dict]) -> dict:
        """A whole push on this worker in one call: vLLM's start, the push's one chunk, vLLM's
        finish (vLLM's own worker methods, one after the other), each step's seconds, and how the
        push was applied; a failure names its step (``StepFailed``). A chunk that fails is raised
        with the update left open, as after vLLM's own update call: the engine's abort ends it
        (``skyinfer_end_weight_update``)."""
        receiver = self.weight_transfer_engine

        def receive() -> None:
            self.update_weights(update_info)
            _raise_kept_failure(receiver)

        def finish() -> None:
            self.finish_weight_update()
            _raise_kept_failure(receiver)

        stages = {}
        for stage, step in (("start", self.start_weight_update), ("receive", receive), ("finish", finish)):
            started = time.perf_counter()
            try:
                step()
            except Exception as exc:
                raise StepFailed(stage, exc) from exc
            stages[stage] = time.perf_counter() - started
        return {"applied": receiver.last_applied, "stages": stages}

    @answers_every_rank
    def skyinfer_quantized_layers(self) -> list[str]:
        """The model's layers that serve their weights quantized (vLLM's names: ``qkv_proj``), whatever
        quantized them (the checkpoint's int8, an online ``--quantization fp8``): each takes a push
        of all its weights or of none, as its served tensors cannot seed the rest."""
        from ..vllm_api import UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod, UnquantizedLinearMethod

        unquantized = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod)
        return sorted(
            name
            for name, module in self.model_runner.get_model().named_modules()
            if (method := getattr(module, "quant_method", None)) is not None
            and not isinstance(method, unquantized)
            and any(True for _ in module.parameters(recurse=False))
        )

    @answers_every_rank
    def skyinfer_give_back_memory(self) -> None:
        """After a push's finish: what it freed goes back to the kernel (and the GPU)."""
        give_back_freed_memory()

    @answers_every_rank
    def skyinfer_end_weight_update(self) -> None:
        """End a weight update however it went, so that the engine can serve again once it holds
        weights worth serving. vLLM's finish does it for an update whose chunks all arrived; after
        a failed chunk vLLM drops its session but leaves the layerwise reload open (layers on the
        meta device, which the next forward would die on): the backend's own finish closes it,
        giving the layers that received nothing their old tensors back. What the receiver kept open
        for its trainer's next push (a segment's mapping, a packed buffer) goes: the trainer of an
        aborted update may be gone."""
        engine = self.weight_transfer_engine
        try:
            if getattr(self, "_weight_update_active", False):
                self.finish_weight_update()
            else:
                engine.finish_weight_update()
                engine.reset_weight_update_target()
        finally:
            engine.drop_kept()

    @answers_every_rank
    def skyinfer_load_checkpoint(self) -> int:
        """Inside a weight update (started by the front), load the checkpoint on disk, as vLLM
        read it at start-up: a push whose tensors come from the model's own files. vLLM's finish
        then closes the layerwise reload. How many tensors were loaded."""
        from ..vllm_api import get_model_loader

        model = self.model_runner.get_model()
        loader = get_model_loader(self.vllm_config.load_config)
        return len(self.weight_transfer_engine.load(loader.get_all_weights(self.model_config, model)))

    @answers_every_rank
    def skyinfer_receive_adapter(self, update_info: dict, directory: str) -> dict:
        """Receive a LoRA adapter's tensors over the weight-transfer group, whatever its backend,
        and write them where the engine loads the adapter from. The model's own weights are
        never touched: vLLM's supported way to aim an update elsewhere points it at a copy in host memory."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer group: POST /init_weight_transfer first")
        collector = CopyTarget(torch.device("cpu"), pinned=False)
        engine.set_weight_update_target(collector, engine.model_config)
        try:
            engine.receive_weights(engine.parse_update_info(update_info))
        finally:
            engine.reset_weight_update_target()
        # Every worker of the engine (of every data-parallel rank) takes part in the broadcast; one writes the file.
        if worker_index(self.parallel_config) == 0:
            save_file(collector.tensors, os.path.join(directory, ADAPTER_WEIGHTS_FILE))
        return {"tensors": len(collector.tensors)}

    # -- staged pushes (staging.py, targets.py) -----------------------------------------
    @answers_every_rank
    def skyinfer_stage_weights(self, update_info: dict, update_nbytes: int) -> dict:
        """Begin receiving a push into a staging copy, on a thread: returns at once."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer group: POST /init_weight_transfer first")
        current = getattr(self, "_skyinfer_staged", None)
        if current is not None and current.receiving:
            raise RuntimeError("a staged receive this worker dropped is still blocked in the transfer")
        # A later chunk of the same update adds to its copy (a dropped copy is gone, with its update).
        adding_to = current if current is not None and not current.target.dropped else None
        # An unquantized model is staged in its own layout and processed as vLLM processes it
        # (targets.py); a quantized one as the checkpoint's tensors, swapped in through vLLM's reload.
        in_shadow = self.vllm_config.quant_config is None
        self._skyinfer_staged = StagedPush(
            engine,
            update_info,
            update_nbytes,
            adding_to=adding_to,
            shadow_of=self.model_runner.get_model() if in_shadow else None,
            vllm_config=self.vllm_config,
            in_place=self.device.type == "cuda" or os.environ.get(STAGED_SWAP_ENV) == "in-place",
        )
        return self._skyinfer_staged.status()

    @answers_every_rank
    def skyinfer_staging_status(self) -> dict:
        staged = getattr(self, "_skyinfer_staged", None)
        return {"state": "none"} if staged is None else staged.status()

    @answers_every_rank
    def skyinfer_swap_staged(self) -> dict:
        """Swap the staged copy into the live weights, then drop it, in this one call (between two
        steps of the engine). An unquantized model takes its shadow, staged and processed beside it:
        copied into the live tensors on a GPU (CUDA graphs hold their addresses), pointed at on CPU.
        A quantized model goes through vLLM's own weight update, started and finished here."""
        staged = getattr(self, "_skyinfer_staged", None)
        if staged is None:
            raise RuntimeError("no staged push on this worker")
        _forget_base(self)
        model = self.model_runner.get_model()
        if self.vllm_config.quant_config is None:
            swapped = staged.swap_into(model, self.device)
            self.model_runner.reset_lora_state()
        else:
            self.start_weight_update()
            try:
                # vLLM's update target is the live model, its layerwise reload opened by the start.
                swapped = staged.swap_into(self.weight_transfer_engine.model, self.device)
            finally:
                # Layers that received nothing get their old tensors back (a failed swap's engine is stale).
                self.finish_weight_update()
            # The finish keeps what it refused (part of a quantized layer, which kept its old
            # weights whole) rather than raise it through the executor: asked, it fails the swap.
            failure, self.weight_transfer_engine.update_failure = self.weight_transfer_engine.update_failure, None
            if failure is not None:
                self._skyinfer_staged = None
                raise failure
        self._skyinfer_staged = None
        if not isinstance(staged.target, ShadowTarget):  # a shadow's old tensors go on their own thread
            give_back_freed_memory()
        return {"tensors": swapped, "installed": staged.target.installed}

    @answers_every_rank
    def skyinfer_drop_staged(self) -> dict:
        staged = getattr(self, "_skyinfer_staged", None)
        if staged is None:
            return {"dropped": False}
        staged.drop()
        if not staged.receiving:
            self._skyinfer_staged = None
        # else kept (dropped) until its receive ends, so that no new one starts meanwhile
        give_back_freed_memory()
        return {"dropped": True}

    @answers_every_rank
    def skyinfer_export_weights(self, prefix: str) -> dict:
        """Write what this worker serves with into its catch-up file (the front removes it), and
        vLLM's checksums of it, taken in the same call: nothing can change them in between."""
        model_tensors = served_tensors(self.model_runner.get_model())
        size = export_tensors(model_tensors, catch_up_file(prefix, worker_index(self.parallel_config)))
        return {"tensors": len(model_tensors), "bytes": size, "checksums": self.compute_weight_checksums()}

    @answers_every_rank
    def skyinfer_import_weights(self, prefix: str) -> dict:
        """Copy a peer worker of the same place's catch-up file into this worker's tensors, in place
        (CUDA graphs keep pointing at them), after checking that every tensor matches."""
        model = self.model_runner.get_model()
        _forget_base(self)
        copied = import_tensors(served_tensors(model), catch_up_file(prefix, worker_index(self.parallel_config)))
        return {"tensors": copied, "repacked": pack_cpu_gemms(model.modules())}
