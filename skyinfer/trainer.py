"""The trainer's side of weight sync, one helper per transport (``skyinfer.transfer`` holds each with
its engine side). Each needs torch and skyinfer's HTTP client, never vLLM, and has the same shape:
``init()`` once, then ``push(named_tensors, version=..., verify=...)`` per step.

- ``GlooTrainer``: engines on separate devices, CPU (a gloo group; ``push_adapter`` for LoRA).
- ``SharedMemoryTrainer``: a trainer colocated with the engines on CPU (``skyinfer serve --colocate``).
- ``IPCTrainer``: a trainer colocated with the engines on GPUs (CUDA IPC; multi-rank trainers too).
- ``ShardedPush``: every rank of a sharded trainer (DTensors sharded on their first dimension)
  diffs its own shard; rank 0's ``GlooTrainer`` pushes the changed elements as one delta.

On GPUs with the engines on devices of their own, vLLM's NCCL trainer engine drives skyinfer as
it drives ``vllm serve``.
"""

from .transfer.gloo import GlooTrainer
from .transfer.ipc import IPCTrainer
from .transfer.sharded import ShardedPush
from .transfer.shm import SharedMemoryTrainer

__all__ = ["GlooTrainer", "IPCTrainer", "ShardedPush", "SharedMemoryTrainer"]
