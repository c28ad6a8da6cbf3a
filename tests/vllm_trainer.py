"""A trainer made of vLLM's own trainer-side pieces, in a process of its own, as a training script
that uses no skyinfer code pushes: ``HTTPVLLMWeightSyncClient`` for the calls and vLLM's
stateless gloo helper for the group, as rank 0. It sends its init, then takes ``--listen-late``
seconds before it listens (a trainer that loads its model meanwhile), then pushes every tensor of
WEIGHTS, one broadcast each, and finishes the update as VERSION.

    python tests/vllm_trainer.py URL WEIGHTS VERSION MASTER_PORT [--listen-late S]

Prints ``pushed VERSION`` and exits 0, or exits 1 with what failed.
"""

import argparse
import sys
import threading
import time

import requests
from safetensors.torch import load_file
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient


def in_thread(call, *args) -> tuple[threading.Thread, list[BaseException]]:
    """``call`` on a thread of its own (its HTTP answer comes once the group has done its part)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call(*args)
        except BaseException as exc:  # reported by the caller
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("weights")
    p.add_argument("version")
    p.add_argument("master_port", type=int)
    p.add_argument("--listen-late", type=float, default=0.0)
    args = p.parse_args()
    client = HTTPVLLMWeightSyncClient(args.url)
    world_size = 1 + requests.get(f"{args.url}/get_world_size", timeout=30).json()["world_size"]
    init_info = {"master_address": "127.0.0.1", "master_port": args.master_port, "world_size": world_size}
    joining, failed = in_thread(client.init_weight_transfer_engine, init_info)
    time.sleep(args.listen_late)
    tensors = load_file(args.weights)
    group = stateless_init_torch_distributed_process_group("127.0.0.1", args.master_port, 0, world_size, backend="gloo")
    joining.join()
    if failed:
        print(f"init failed: {failed[0]}", file=sys.stderr)
        return 1
    client.start_weight_update()
    names = sorted(tensors)
    update_info = {
        "names": names,
        "dtype_names": [str(tensors[name].dtype).removeprefix("torch.") for name in names],
        "shapes": [list(tensors[name].shape) for name in names],
    }
    updating, failed = in_thread(client.update_weights, update_info)
    for name in names:
        group.broadcast(tensors[name].contiguous(), 0).wait()
    updating.join()
    if failed:
        print(f"update failed: {failed[0]}", file=sys.stderr)
        return 1
    try:
        client.finish_weight_update(args.version)
    except requests.HTTPError as exc:
        print(f"finish failed: {exc.response.status_code} {exc.response.text}", file=sys.stderr)
        return 1
    print("pushed", args.version, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
