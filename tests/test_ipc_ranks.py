"""A multi-rank ``IPCTrainer`` keeps its ranks in step whatever the server answers (issue 43).

Two real trainer processes form a gloo group and push through ``IPCTrainer``, its CUDA steps (the
copy to the GPU, the handle export, the IPC clean-up) replaced by CPU stand-ins, against a small
server that refuses the call a case names. Every rank must return or raise the server's refusal,
within a bound: a rank left in a collective its peer never joins is a deadlock. The ranks push a
second time after a refusal, so one that left them a collective apart would show there too.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from aiohttp import web

from skyinfer.client import SkyinferError
from skyinfer.errors import TRANSFER_GROUP_GONE, error_body, json_response
from skyinfer.transfer.ipc import IPCTrainer, PackedBuffer
from skyinfer.transfer.protocol import LAYOUT_FIELDS, layout_id

WORLD_SIZE = 2
# Both ranks start torch, form the group and push twice well within this on a 2-core machine.
EXIT_WITHIN_S = 60


class CpuIPCTrainer(IPCTrainer):
    """``IPCTrainer`` with a CPU stand-in for each CUDA step: a rank's "handle" names its rank.
    ``export_fails``: the export raises, as a GPU out of memory would."""

    export_fails = False

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().contiguous()

    def _export_handles(self, tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, dict]]:
        rank = dist.get_rank()
        if self.export_fails:
            raise RuntimeError(f"CUDA out of memory on rank {rank} (a stand-in)")
        return [{f"gpu-{rank}": {"rank": rank, "tensor": name}} for name, _ in tensors]

    def _new_buffer(self, nbytes: int) -> PackedBuffer:
        rank = dist.get_rank()
        if self.export_fails:
            raise RuntimeError(f"CUDA out of memory on rank {rank} (a stand-in)")
        return PackedBuffer(torch.empty(nbytes, dtype=torch.uint8), {f"gpu-{rank}": {"rank": rank, "buffer": True}})

    def _release_exported(self) -> None:
        pass  # no CUDA IPC memory to collect


def trainer_rank(
    rank: int, init_method: str, url: str, versions: list[str], export_fails_on: int | None, packed: bool, results
) -> None:
    """One rank of the trainer (a process of its own): init, then a push per version; puts each
    push's outcome, as the training script would see it, on ``results``."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    trainer = CpuIPCTrainer(url, timeout_s=30, packed=packed)
    trainer.export_fails = rank == export_fails_on
    outcomes = []
    try:
        trainer.init()
        for version in versions:
            tensors = [("w", torch.full((2, 3), float(rank))), ("b", torch.zeros(3))]
            try:
                trainer.push(tensors, version=version)
                outcomes.append("pushed")
            except SkyinferError as exc:
                outcomes.append(f"SkyinferError {exc.status} {exc.code}: {exc.message}")
            except RuntimeError as exc:
                outcomes.append(f"RuntimeError: {exc}")
    finally:
        results.put((rank, outcomes))
        trainer.close()
        dist.destroy_process_group()


class RefusingServer:
    """The weight-transfer routes of a skyinfer server: each answers 200, except that a route given
    refusals answers them first, one a call, in the OpenAI error shape."""

    def __init__(self, refusals: dict[str, list[tuple[int, str, str | None]]] | None = None):
        self.refusals = refusals or {}
        self.calls: list[tuple[str, dict | None]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{route}", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, await request.json() if request.can_read_body else None))
        pending = self.refusals.get(request.path)
        if pending:
            status, message, code = pending.pop(0)
            return json_response(error_body(status, message, code=code), status=status)
        return json_response({"status": "ok"})

    def routes(self) -> list[str]:
        return [path for path, _ in self.calls]

    def updates(self) -> list[dict]:
        return [body for path, body in self.calls if path == "/update_weights"]


async def run_ranks(
    aiohttp_server,
    tmp_path,
    server: RefusingServer,
    versions: list[str],
    export_fails_on: int | None = None,
    packed: bool = True,
) -> dict[int, list[str]]:
    """Both ranks against ``server``; each one's outcomes, once both have exited (within the bound)."""
    url = str((await aiohttp_server(server.app())).make_url(""))
    # Forked from multiprocessing's fork server, which imported torch and skyinfer's IPC trainer
    # once: a fresh process per rank would import them again (about 2.5 CPU-seconds each).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "skyinfer.transfer.ipc", __name__])
    results = context.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        context.Process(target=trainer_rank, args=(rank, init_method, url, versions, export_fails_on, packed, results))
        for rank in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    try:
        # Waited for here without blocking: the server answers on this event loop.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXIT_WITHIN_S
        while any(p.is_alive() for p in ranks) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        stuck = [rank for rank, p in enumerate(ranks) if p.is_alive()]
        assert not stuck, f"rank(s) {stuck} still in the push after {EXIT_WITHIN_S}s, server calls {server.routes()}"
        assert [p.exitcode for p in ranks] == [0] * WORLD_SIZE
        return dict(results.get(timeout=10) for _ in ranks)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(10)


def assert_carries_both_ranks(update: dict, packed: bool = True, in_full: bool = True) -> None:
    """One update with every rank's handle: of its packed buffer (the tensors' sizes in it, for the
    engines to keep open), or of each tensor, in the order rank 0 named the tensors; the tensors
    listed (``in_full``: the server has not taken a push of their layout yet) or named by their
    layout's id alone."""
    info = update["update_info"]
    fields = {"names": ["w", "b"], "dtype_names": ["float32"] * 2, "shapes": [[2, 3], [3]]}
    if packed:
        fields["tensor_sizes"] = [24, 12]
    assert info["layout"] == layout_id(fields)
    if in_full:
        assert {key: info[key] for key in fields} == fields
    else:
        assert not set(LAYOUT_FIELDS) & set(info), info
    if packed:
        assert info["ipc_handles"] == {f"gpu-{rank}": {"rank": rank, "buffer": True} for rank in range(WORLD_SIZE)}
        assert info["reuse"] is True
        return
    assert info["ipc_handles"] == [
        {f"gpu-{rank}": {"rank": rank, "tensor": name} for rank in range(WORLD_SIZE)} for name in ("w", "b")
    ]


@pytest.mark.parametrize(
    ("route", "status", "message"),
    [
        ("/start_weight_update", 409, "a weight update is in progress already"),
        ("/update_weights", 400, "update_info says float32 for w, the checkpoint bfloat16"),
        ("/finish_weight_update", 409, "no weight update is in progress"),
    ],
    ids=["start", "update", "finish"],
)
async def test_every_rank_raises_a_refusal_of_rank_0s_call_and_the_next_push_goes_through(
    aiohttp_server, tmp_path, route, status, message
):
    server = RefusingServer({route: [(status, message, None)]})
    outcomes = await run_ranks(aiohttp_server, tmp_path, server, ["v1", "v2"])
    # The same refusal on every rank, with the status and code the client gives rank 0.
    assert outcomes == {rank: [f"SkyinferError {status} {status}: {message}", "pushed"] for rank in range(WORLD_SIZE)}
    calls_of_the_refused_push = {
        "/start_weight_update": ["/start_weight_update"],
        "/update_weights": ["/start_weight_update", "/update_weights"],
        "/finish_weight_update": ["/start_weight_update", "/update_weights", "/finish_weight_update"],
    }[route]
    assert server.routes() == [
        "/init_weight_transfer",
        *calls_of_the_refused_push,
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    ]
    for update in server.updates():
        assert_carries_both_ranks(update)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a handle per tensor"])
async def test_every_rank_pushes_its_handles_in_rank_0s_one_update(aiohttp_server, tmp_path, packed):
    server = RefusingServer()
    outcomes = await run_ranks(aiohttp_server, tmp_path, server, ["v1", "v2"], packed=packed)
    assert outcomes == {rank: ["pushed", "pushed"] for rank in range(WORLD_SIZE)}
    assert (
        server.routes()
        == ["/init_weight_transfer"] + ["/start_weight_update", "/update_weights", "/finish_weight_update"] * 2
    )
    first, second = server.updates()
    assert_carries_both_ranks(first, packed)
    assert_carries_both_ranks(second, packed, in_full=False)  # the server took a push of that layout
    assert [body["weight_version"] for path, body in server.calls if path == "/finish_weight_update"] == ["v1", "v2"]


async def test_rank_0_setting_the_transfer_up_again_mid_push_keeps_the_ranks_in_step(aiohttp_server, tmp_path):
    # The engines left the transfer: rank 0 alone sets it up again and retries, inside the push
    # every rank is already part of.
    server = RefusingServer({"/start_weight_update": [(409, "the engines left the transfer", TRANSFER_GROUP_GONE)]})
    outcomes = await run_ranks(aiohttp_server, tmp_path, server, ["v1", "v2"])
    assert outcomes == {rank: ["pushed", "pushed"] for rank in range(WORLD_SIZE)}
    assert server.routes()[:3] == ["/init_weight_transfer", "/start_weight_update", "/init_weight_transfer"]
    assert len(server.updates()) == 2


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a handle per tensor"])
async def test_a_rank_whose_export_fails_stops_the_push_on_every_rank_before_any_server_call(
    aiohttp_server, tmp_path, packed
):
    server = RefusingServer()
    outcomes = await run_ranks(aiohttp_server, tmp_path, server, ["v1"], export_fails_on=1, packed=packed)
    assert outcomes == {
        0: ["RuntimeError: rank 1 failed: RuntimeError: CUDA out of memory on rank 1 (a stand-in)"],
        1: ["RuntimeError: CUDA out of memory on rank 1 (a stand-in)"],
    }
    assert server.routes() == ["/init_weight_transfer"]
