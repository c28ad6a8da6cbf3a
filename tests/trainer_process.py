"""A trainer in its own process, as a training script would be: torch and skyinfer.trainer only.

    python tests/trainer_process.py URL WEIGHTS.safetensors VERSION [--one-call] [--transport gloo|shm]
        [--die-after N | --hang-after N | --die-at init|start|segment|update|finish] [--verify]
        [--staged] [--kv recompute|keep]
        [--expect CHECKSUMS.json] [--client skyinfer|vllm|trl] [--pause-keep] [--colocated-step LEVEL]
        [--listen-late S] [--as-is]
    python tests/trainer_process.py URL ADAPTER_DIR VERSION --adapter NAME [--die-after N]

With ``--adapter`` it pushes a PEFT adapter directory's tensors and config as LoRA adapter NAME.
With ``--more`` it stays up after its push, as a training loop would: each line ``WEIGHTS VERSION``
on its stdin is one more push with the same trainer, answered ``pushed VERSION`` (or a refusal).
With ``--hold-before-update`` it prints ``before update`` once its update is started and makes
the update call only when a line arrives on its stdin, then prints how long that call took.
With ``--hold-before-finish`` it prints ``before finish`` once every chunk was sent and makes the
finish call only when a line arrives on its stdin.
With ``--start-names-nothing`` its start carries no metadata (as vLLM's client starts an update):
each chunk names its tensors.
With ``--listen-late S`` it sends its init and only S seconds later listens as the group's rank 0
(a trainer that loads its model meanwhile). With ``--delta-from BASE`` it first pushes BASE whole, so
that its push (and its fault) is a delta on it.

Exits 0 after a push; prints a refusal's status and message and exits 3; with
--die-after it sends N tensors one by one (with ``--bucket-bytes B``, N buckets of about B bytes
packed) and then dies mid-transfer; with
--hang-after it sends N and then waits for ever, holding the transfer open;
with --die-at it dies (exit 9) right after joining the group, right after
starting the update, after writing its shared-memory segment (shm) and before sending it, while
the update call is in flight, or right before finishing it; with --stop-before-update it
SIGSTOPs a process (an engine's) right before its update call. ``--transport shm`` pushes with
``SharedMemoryTrainer`` into a colocated server, ``--transport ipc`` with ``IPCTrainer``
(into a CPU server's stand-in for CUDA IPC: ``--colocate --weight-transport ipc``); ``--colocated-step LEVEL`` wraps the push in a
colocated trainer's step: sleep at LEVEL, wake the weights, push, wake the KV cache. ``--client`` picks who makes
the push's HTTP calls: skyinfer's client, vLLM's ``HTTPVLLMWeightSyncClient``, or
the calls TRL's async GRPO trainer makes (its bodies, sent with ``requests``);
``--pause-keep`` wraps the push in ``/pause?mode=keep`` and ``/resume`` as TRL does.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import requests
from safetensors.torch import load_file

from skyinfer.client import SkyinferError
from skyinfer.trainer import GlooTrainer, IPCTrainer, SharedMemoryTrainer


class TrlCalls:
    """The weight-sync calls of TRL's async GRPO trainer, with the bodies it sends."""

    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, body: dict | None = None, params: dict | None = None) -> None:
        requests.post(f"{self.url}{path}", json=body, params=params, timeout=300).raise_for_status()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {"is_checkpoint_format": True})

    def update_weights(self, update_info: dict) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {})


def sync_client(kind: str, url: str):
    if kind == "vllm":
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(url)
    return TrlCalls(url) if kind == "trl" else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url", help="a skyinfer server, or several (one per node) separated by commas")
    p.add_argument("weights")
    p.add_argument("version")
    p.add_argument("--one-call", action="store_true")
    p.add_argument("--staged", action="store_true", help="a staged push: received while the engines generate")
    p.add_argument("--kv", choices=["recompute", "keep"], default="recompute")
    p.add_argument("--die-after", type=int)
    p.add_argument(
        "--bucket-bytes",
        type=int,
        help="gloo: packed into buckets of about this many bytes (die or hang after N buckets)",
    )
    p.add_argument("--hang-after", type=int)
    p.add_argument("--die-at", choices=["init", "start", "segment", "update", "finish"])
    p.add_argument("--verify", action="store_true")
    p.add_argument("--expect", help="a JSON file of the checksums every engine must hold after the push")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--client", choices=["skyinfer", "vllm", "trl"], default="skyinfer")
    p.add_argument("--pause-keep", action="store_true")
    p.add_argument("--as-is", action="store_true", help="send every tensor as it is (no quantizing for the engines)")
    p.add_argument("--adapter", help="push WEIGHTS (a PEFT adapter directory) as this LoRA adapter")
    p.add_argument("--transport", choices=["gloo", "shm", "ipc"], default="gloo")
    p.add_argument("--colocated-step", type=int, choices=[0, 1, 2], metavar="LEVEL")
    p.add_argument(
        "--stop-before-update", type=int, metavar="PID", help="SIGSTOP this process right before the update call"
    )
    p.add_argument("--hold-before-update", action="store_true", help="wait for a line on stdin before the update call")
    p.add_argument("--hold-before-finish", action="store_true", help="wait for a line on stdin before the finish")
    p.add_argument(
        "--start-names-nothing",
        action="store_true",
        help="start the update without its metadata (as vLLM's client starts one): each chunk names its tensors",
    )
    p.add_argument("--more", action="store_true", help="then push WEIGHTS VERSION from each line of stdin")
    p.add_argument(
        "--delta-from",
        metavar="BASE",
        help="first push BASE whole (as VERSION-base), so that the push is a delta on it",
    )
    p.add_argument(
        "--listen-late", type=float, metavar="S", help="send the init, then take S seconds (loading a model) to listen"
    )
    args = p.parse_args()
    if args.adapter:
        tensors = load_file(os.path.join(args.weights, "adapter_model.safetensors"))
        with open(os.path.join(args.weights, "adapter_config.json")) as f:
            peft_config = json.load(f)
    else:
        tensors = load_file(args.weights)
    urls = args.url.split(",")
    stop_after = args.die_after if args.die_after is not None else args.hang_after
    if args.transport == "shm":
        trainer = SharedMemoryTrainer(urls[0], timeout_s=args.timeout)
    elif args.transport == "ipc":
        trainer = IPCTrainer(urls[0], timeout_s=args.timeout)
    else:
        trainer = GlooTrainer(
            urls if len(urls) > 1 else urls[0],
            timeout_s=args.timeout,
            packed=stop_after is None or args.bucket_bytes is not None,
            **({"buffer_size_bytes": args.bucket_bytes} if args.bucket_bytes else {}),
            sync_client=sync_client(args.client, urls[0]),
        )
    if args.pause_keep:
        TrlCalls(urls[0]).post("/pause", params={"mode": "keep"})
    if args.colocated_step is not None:
        # As SkyRL's colocated trainer: asleep already (a step cut short), or put to sleep now.
        if not requests.get(f"{urls[0]}/is_sleeping", timeout=60).json()["is_sleeping"]:
            TrlCalls(urls[0]).post("/sleep", params={"level": str(args.colocated_step)})
        TrlCalls(urls[0]).post("/wake_up", params={"tags": "weights"})
    if args.listen_late:
        from skyinfer.transfer import gloo

        forming = gloo._gloo_group

        def form_late(*a, **kw):
            time.sleep(args.listen_late)
            return forming(*a, **kw)

        gloo._gloo_group = form_late
    trainer.init()
    if args.delta_from:  # before any fault is set up: the base every engine takes
        trainer.push(load_file(args.delta_from).items(), version=f"{args.version}-base", one_call=True)
        sending = trainer._update_weights

        def say_if_delta(update_info, *a, **kw):
            if "delta" in update_info and not kw.get("check_only"):
                print("sending a delta", flush=True)
            return sending(update_info, *a, **kw)

        trainer._update_weights = say_if_delta
    client = trainer.client
    if args.die_at == "init":
        os._exit(9)
    if args.die_at == "start":
        started = client.start_weight_update
        client.start_weight_update = lambda *a, **kw: (started(*a, **kw), os._exit(9))
    updating = trainer._calls.update_weights

    def on_the_update_call(fault):
        """``fault`` in place of the update call; the check a one-call push asks first goes as it is."""
        trainer._calls.update_weights = lambda *a, **kw: updating(*a, **kw) if kw.get("check_only") else fault(*a, **kw)

    if args.stop_before_update is not None:
        # A fault at exactly this phase: an engine hangs as the update reaches it.
        def stop_then_update(*a, **kw):
            os.kill(args.stop_before_update, signal.SIGSTOP)
            return updating(*a, **kw)

        on_the_update_call(stop_then_update)
    if args.hold_before_update:
        # Whoever runs it does something to the fleet first (the update call may then wait for it).
        def update_when_told(*a, **kw):
            print("before update", flush=True)
            sys.stdin.readline()
            started = time.monotonic()
            updating(*a, **kw)
            print(f"update took {time.monotonic() - started:.1f}s", flush=True)

        on_the_update_call(update_when_told)
    if args.die_at == "segment":
        # The segment is written; the call that would name it to the server is never made.
        on_the_update_call(lambda *a, **kw: os._exit(9))
    elif args.die_at == "update":
        # Dies while its update call is in flight.
        def update_then_die(*a, **kw):
            threading.Thread(target=updating, args=a, kwargs=kw, daemon=True).start()
            time.sleep(0.02)
            os._exit(9)

        on_the_update_call(update_then_die)
    if args.start_names_nothing:
        starting = client.start_weight_update
        client.start_weight_update = lambda update_info, **kw: starting(None, **kw)
    finishing = client.finish_weight_update
    if args.die_at == "finish":
        client.finish_weight_update = lambda *a, **kw: os._exit(9)
    elif args.expect:
        with open(args.expect) as f:
            expected = json.load(f)
        client.finish_weight_update = lambda version, verify, kv: finishing(version, verify, expected, kv)
    elif args.hold_before_finish:
        # Whoever runs it does something to the fleet between the last chunk and the finish.
        def finish_when_told(*a, **kw):
            print("before finish", flush=True)
            sys.stdin.readline()
            return finishing(*a, **kw)

        client.finish_weight_update = finish_when_told
    if stop_after is not None:
        sent = 0
        real_start = trainer._start_broadcast

        def send_then_stop(tensor):
            nonlocal sent
            if sent == stop_after:
                if args.die_after is not None:
                    os._exit(9)  # mid-transfer, as a crash would
                print("hanging", flush=True)
                time.sleep(3600)
            work = real_start(tensor)
            work.wait()  # sent whole before the next starts: the fault comes after exactly N
            sent += 1
            return work

        trainer._start_broadcast = send_then_stop
    try:
        if args.adapter:
            trainer.push_adapter(args.adapter, tensors.items(), peft_config, version=args.version)
        else:
            trainer.push(
                tensors.items(),
                version=args.version,
                one_call=args.one_call,
                verify=args.verify,
                staged=args.staged,
                kv=args.kv,
                quantize=not args.as_is,
            )
    except SkyinferError as exc:
        print(f"refused {exc.status}: {exc.message}", flush=True)
        return 3
    if args.pause_keep:
        TrlCalls(urls[0]).post("/resume")
    if args.colocated_step is not None:
        TrlCalls(urls[0]).post("/wake_up", params={"tags": "kv_cache"})
    assert args.client == "vllm" or "vllm" not in sys.modules, "the trainer must not need vLLM"
    print("pushed", args.version, flush=True)
    if args.more:
        for line in sys.stdin:
            weights, version = line.split()
            try:
                trainer.push(load_file(weights).items(), version=version)
            except SkyinferError as exc:
                print(f"refused {exc.status}: {exc.message}", flush=True)
                continue
            print("pushed", version, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
