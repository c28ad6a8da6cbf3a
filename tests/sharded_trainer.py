"""A sharded trainer for tests: two ranks of one torch.distributed gloo group, each holding half of
every weight (a DTensor sharded on its first dimension), pushing through ``ShardedPush``; rank 0's
``GlooTrainer`` talks to the server.

Usage: sharded_trainer.py URL RANK PORT WEIGHTS:VERSION [WEIGHTS:VERSION ...]

Each push in turn; after each, each rank prints how many tensors went sparse, how many whole, and
how many it took part in gathering whole (``DTensor.full_tensor``)."""

from __future__ import annotations

import sys

import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from skyinfer.trainer import GlooTrainer, ShardedPush
from skyinfer.transfer.delta import DENSE


def main() -> None:
    url, rank, port, *pushes = sys.argv[1:]
    rank = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    trainer = None
    if rank == 0:
        trainer = GlooTrainer(url, timeout_s=60)
        trainer.init()
    pusher = ShardedPush(trainer)
    gathered = 0
    full_tensor = DTensor.full_tensor

    def counted(self):
        nonlocal gathered
        gathered += 1
        return full_tensor(self)

    DTensor.full_tensor = counted
    for push in pushes:
        path, version = push.rsplit(":", 1)
        named = [
            (name, distribute_tensor(t, mesh, [Shard(0)] if t.ndim and t.shape[0] % 2 == 0 else [Replicate()]))
            for name, t in load_file(path).items()
        ]
        gathered = 0
        pusher.push(named, version)
        sparse = sum(1 for count in pusher.last_changed if count > 0)
        whole = sum(1 for count in pusher.last_changed if count == DENSE)
        print(f"rank {rank} pushed {version}: {sparse} sparse, {whole} whole, {gathered} gathered", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
