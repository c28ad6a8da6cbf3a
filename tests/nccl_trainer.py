"""A trainer of vLLM's own NCCL trainer engine (``NCCLTrainerWeightTransferEngine``), unchanged, in
a process of its own, as the README's GPU loop drives it: ``trainer_init`` with skyinfer's
``Client`` as its client and a weight source, ``send_weights``, then ``update_weight_version``.
Only NCCL's device primitives are stood in, as a CPU has neither: NCCL's communicator by
skyinfer's ``GlooCommunicator`` (the same constructor and calls, over vLLM's own rendezvous), CUDA's
streams by ones with nothing to wait for. The engines must be a CPU server's with
``--weight-transport nccl``, whose receivers stand in the same way.

    python tests/nccl_trainer.py URL WEIGHTS VERSION [--unpacked] [--buffer-bytes N]
        [--die-after N | --hang-after N] [--more]

Prints ``pushed VERSION`` and exits 0. With ``--die-after N`` the weight source dies (exit 9) once
it has given N tensors, mid-push, as a trainer killed while it sends; with ``--hang-after N`` it
prints ``hanging after N tensors`` there and waits for ever, holding the transfer open. With ``--more`` it stays up:
each line ``WEIGHTS VERSION`` on its stdin is one more push with the same trainer engine.
A push the server refuses exits 3, printing ``refused STATUS MESSAGE``.
"""

import argparse
import contextlib
import os
import socket
import sys
import threading

import torch
from safetensors.torch import load_file
from vllm.distributed.device_communicators import pynccl
from vllm.distributed.weight_transfer import packed_tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from skyinfer.client import Client, SkyinferError
from skyinfer.transfer.nccl import GlooCommunicator


class _NoStream:
    """A CUDA stream's calls, with nothing to wait for: CPU work is done when its call returns."""

    cuda_stream = 0

    def synchronize(self) -> None:
        pass


def stand_in_for_the_device() -> None:
    """NCCL's communicator and CUDA's streams, as vLLM's trainer engine reaches them, stood in."""
    pynccl.PyNcclCommunicator = GlooCommunicator
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.accelerator.current_device_index = lambda: 0
    packed_tensor._get_streams = lambda device, num_buffers: tuple(_NoStream() for _ in range(num_buffers))


class FileSource(WeightSource):
    """A safetensors file's tensors, in its order; with ``die_after`` the process dies once it gave that many."""

    def __init__(self, path: str, die_after: int | None = None, hang_after: int | None = None) -> None:
        self.tensors = load_file(path)
        self.die_after = die_after
        self.hang_after = hang_after

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self):
        for given, (name, tensor) in enumerate(self.tensors.items()):
            if given == self.die_after:
                print(f"dying after {given} tensors", flush=True)
                os._exit(9)
            if given == self.hang_after:
                print(f"hanging after {given} tensors", flush=True)
                threading.Event().wait()
            yield name, tensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def push(engine: NCCLTrainerWeightTransferEngine, client: Client, source: FileSource, version: str) -> None:
    engine.source = source
    engine.send_weights()
    client.update_weight_version(version)
    print("pushed", version, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("weights")
    p.add_argument("version")
    p.add_argument("--unpacked", action="store_true", help="one broadcast per tensor (vLLM's packed=False)")
    p.add_argument("--buffer-bytes", type=int, default=packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    faults = p.add_mutually_exclusive_group()
    faults.add_argument("--die-after", type=int)
    faults.add_argument("--hang-after", type=int)
    p.add_argument("--more", action="store_true")
    args = p.parse_args()
    stand_in_for_the_device()
    client = Client(args.url, timeout_s=120)
    source = FileSource(args.weights, args.die_after, args.hang_after)
    init_info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        rank=0,
        world_size=1 + client.get_world_size(),
        packed=not args.unpacked,
        packed_buffer_size_bytes=args.buffer_bytes,
    )
    try:
        engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client, source=source)
        push(engine, client, source, args.version)
        if args.more:
            for line in sys.stdin:
                weights, version = line.split()
                push(engine, client, FileSource(weights), version)
    except SkyinferError as exc:
        print(f"refused {exc.status} {exc.message}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
