"""Engine-side weight-transfer routes: vLLM's own calls, plus waiting out the rendezvous, staged
pushes and peer catch-up. The front has already checked order and metadata; these run the calls on
this engine's AsyncLLM and report how they went."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from ..engine_wire import push_failed_at
from ..errors import error_body, error_response, json_response, parse_json_object
from . import (
    DROP_STAGED_RPC,
    END_WEIGHT_UPDATE_RPC,
    EXPORT_WEIGHTS_RPC,
    GIVE_BACK_MEMORY_RPC,
    IMPORT_WEIGHTS_RPC,
    LOAD_CHECKPOINT_RPC,
    PUSH_RPC,
    STAGE_WEIGHTS_RPC,
    STAGING_STATUS_RPC,
    SWAP_STAGED_RPC,
    UPDATE_OUTCOME_RPC,
)
from .admin import abort, pause
from .appkeys import ENGINE_CLIENT, KV_EPOCHS
from .worker_calls import WorkerFailed, every_worker_answers, on_every_worker

__all__ = ["KvEpochs", "add_weight_routes", "engine_call_route"]

log = logging.getLogger("skyinfer.engine.weights")

STATUS_RPC = "skyinfer_transfer_status"
# How soon a staged push's progress is first asked for; each ask waits for the EngineCore's next step
# boundary, and the wait between asks doubles up to _POLL_CEILING_S. Every ask wakes each EngineCore
# and its workers, whose queue then spins: asked every 10 ms, a dp-2 engine's two workers and two
# EngineCores took 3.3 of this machine's 2 cores and starved the receive they were asked about (pushes
# of a few MB took 30-60 s, a quarter of them timing out in the gloo receive).
_STAGING_FIRST_POLL_S = 0.01
_POLL_CEILING_S = 0.25


class KvEpochs:
    """Keeps a request from reusing a cached prefix computed by other weights.

    A push that keeps the KV of the requests running cannot drop the prefix cache (vLLM drops it
    only when no request holds a block): blocks the old weights computed stay cached. From such a
    push on, every new request's prompt carries a cache salt naming the weights' epoch (with the
    caller's own salt, if any), so that it reuses only prefixes computed since."""

    def __init__(self) -> None:
        self.current = 0

    def install(self, engine_client) -> None:
        generate = engine_client.generate

        def salted(prompt, *args, **kwargs):
            if self.current and isinstance(prompt, dict):
                own = prompt.get("cache_salt")
                prompt = {**prompt, "cache_salt": f"{own or ''}|skyinfer-kv-epoch-{self.current}"}
            return generate(prompt, *args, **kwargs)

        engine_client.generate = salted


async def _after_new_weights(request: web.Request, engine, kv) -> None:
    """vLLM keeps the prefix cache across an update: KV computed with the old weights must not be
    served again, but with "keep" to the requests running now, which go on over the KV they have
    (the caller's off-policy choice): only the cache no request holds is dropped, and new requests
    reuse none of what the old weights computed."""
    keep_kv = kv == "keep"
    if keep_kv:
        request.app[KV_EPOCHS].current += 1
    await engine.reset_prefix_cache(reset_running_requests=not keep_kv)


class _WorkersFailed(Exception):
    """A worker reported ``failed``: its error."""


async def _until_every_worker(poll, ready: str, timeout_s: float, poll_s: float) -> list[dict] | None:
    """Poll every worker's status (``poll()``) until each is ``ready``: their statuses, or None once
    ``timeout_s`` passed (or a worker timed out itself); a worker that failed raises its error. The
    wait between polls starts at ``poll_s`` and doubles up to ``_POLL_CEILING_S``."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = await poll()
        states = {s["state"] for s in statuses}
        if "failed" in states:
            raise _WorkersFailed(next(s["error"] for s in statuses if s["state"] == "failed"))
        if states == {ready}:
            return statuses
        if "timeout" in states or time.monotonic() > deadline:
            return None
        await asyncio.sleep(poll_s)
        poll_s = min(2 * poll_s, max(poll_s, _POLL_CEILING_S))


async def _wait_for_rendezvous(engine, timeout_s: float) -> web.Response:
    try:
        statuses = await _until_every_worker(lambda: every_worker_answers(engine, STATUS_RPC), "ready", timeout_s, 0.1)
    except _WorkersFailed as failed:
        return error_response(502, f"joining the trainer's group failed: {failed}")
    if statuses is None:
        return error_response(504, f"the trainer did not join the weight-transfer group within {timeout_s:.0f}s")
    return json_response({"status": "joined", "workers": len(statuses)})


async def init_weight_transfer(request: web.Request) -> web.Response:
    from ..vllm_api import WeightTransferInitRequest

    engine = request.app[ENGINE_CLIENT]
    # As the front made it for this engine's backend (its rank offset, a timeout where the backend takes one).
    init_info = parse_json_object(await request.read())["init_info"]
    timeout_s = float(request.query["timeout_s"])
    await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
    return await _wait_for_rendezvous(engine, timeout_s)


async def start_weight_update(request: web.Request) -> web.Response:
    await request.app[ENGINE_CLIENT].start_weight_update()
    return json_response({"status": "started"})


async def update_weights(request: web.Request) -> web.Response:
    from ..vllm_api import WeightTransferUpdateRequest

    engine = request.app[ENGINE_CLIENT]
    update_info = parse_json_object(await request.read())["update_info"]
    await engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
    await on_every_worker(engine, UPDATE_OUTCOME_RPC)
    return json_response({"status": "updated"})


async def finish_weight_update(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_CLIENT]
    body = parse_json_object(await request.read())
    await engine.finish_weight_update(body.get("weight_version"))
    applied = await on_every_worker(engine, UPDATE_OUTCOME_RPC)
    await _after_new_weights(request, engine, body.get("kv"))
    await _give_back_after_reload(engine, applied)
    return json_response(
        {"status": "finished", "weight_version": await engine.get_weight_version(), "applied": _of_engine(applied)}
    )


def _of_engine(applied: list[dict | None]) -> dict | None:
    """How the engine applied an update: its first worker's account, able to take a delta on it
    (``base``) only where every worker is."""
    first = applied[0]
    if isinstance(first, dict) and "base" in first:
        return {**first, "base": all(isinstance(a, dict) and a.get("base") is True for a in applied)}
    return first


async def _give_back_after_reload(engine, applied: list[dict]) -> None:
    """After a layerwise reload, the memory of the layers it replaced goes back; an update applied
    in place allocated nothing (what the next push would pay again)."""
    if any(answer["applied"] != "in place" for answer in applied):
        await on_every_worker(engine, GIVE_BACK_MEMORY_RPC)


async def push(request: web.Request) -> web.Response:
    """A whole push on this engine in one call (the front's one-call live push): paused for it
    first if the front asks (keep: requests held with their KV), then vLLM's start, the push's one
    chunk and vLLM's finish in one call of every worker (``skyinfer_push``), then the version and
    the KV rule. The engine stays paused: the front resumes it once every engine has the push, so
    that none serves it unless all took it. The answer carries each stage's seconds as the slowest
    worker timed its own. A failure names the step it failed at (its error's code), and leaves what
    it began (the pause, the open update) for the front's abort and resume to end, as after the
    separate calls."""
    engine = request.app[ENGINE_CLIENT]
    body = parse_json_object(await request.read())
    update_info, version = body["update_info"], str(body["weight_version"])
    step = "pause"
    try:
        started = time.perf_counter()
        if body.get("pause"):
            await pause(engine, "keep", clear_cache=False)
        paused_at = time.perf_counter()
        try:
            pushed = await on_every_worker(engine, PUSH_RPC, update_info)
        except WorkerFailed as failed:
            # A worker that failed at the receive makes it the collective's failure.
            step = "receive" if "receive" in failed.steps or not failed.steps else failed.steps.pop()
            raise
        except Exception:
            step = "receive"  # the EngineCore gone, say: as any failure inside the collective
            raise
        step = "finish"
        received_at = time.perf_counter()
        await engine.update_weight_version(version)
        await _after_new_weights(request, engine, body.get("kv"))
        applied = [answer["applied"] for answer in pushed]
        await _give_back_after_reload(engine, applied)
    except Exception as exc:
        log.exception("/push failed at its %s", step)
        message = f"/push failed in the engine at its {step}: {exc}"
        return json_response(error_body(500, message, code=push_failed_at(step)), status=500)
    slowest = max((answer["stages"] for answer in pushed), key=lambda worker: sum(worker.values()))
    stages = {"pause": paused_at - started, **slowest}
    stages["finish"] += time.perf_counter() - received_at  # the version and KV rule, as a finish sets them
    return json_response(
        {"status": "finished", "weight_version": version, "applied": _of_engine(applied), "stages": stages}
    )


async def stage_weights(request: web.Request) -> web.Response:
    """A staged push's first half: every worker receives the push into a staging copy on a thread
    while the engine generates; the call answers once all have staged it (or one failed)."""
    engine = request.app[ENGINE_CLIENT]
    body = parse_json_object(await request.read())
    timeout_s = float(request.query["timeout_s"])
    await on_every_worker(engine, STAGE_WEIGHTS_RPC, body["update_info"], int(body["update_nbytes"]))
    try:
        statuses = await _until_every_worker(
            lambda: on_every_worker(engine, STAGING_STATUS_RPC), "staged", timeout_s, _STAGING_FIRST_POLL_S
        )
    except _WorkersFailed as failed:
        return error_response(502, f"staging the push failed: {failed}")
    if statuses is None:
        return error_response(504, f"the push was not staged within {timeout_s:.0f}s")
    return json_response(
        {
            "status": "staged",
            "bytes": sum(s["bytes"] for s in statuses),
            "tensors": sum(s["tensors"] for s in statuses),
            "seconds": max(s["seconds"] for s in statuses),
            "place": statuses[0]["place"],
        }
    )


async def swap_staged(request: web.Request) -> web.Response:
    """A staged push's second half: every worker installs its staged copy in the live weights (a
    shadow copied in place or pointed at; a quantized model's through vLLM's layerwise reload,
    opened and closed in the same worker call), then the new version and the KV rule
    (finish_weight_update's), all inside a keep-pause: the engine stops for the swap alone. These
    are separate EngineCore calls, and a step can run between two of them: once in CI, a token the
    old weights made came out labelled with the new version. With vLLM's async scheduling (GPUs) a
    step is in flight besides whenever they arrive. The pause lets that step end and sends its
    tokens under the old version, and no step runs until all are done.
    The version and the KV rule are sent only once every worker has swapped: an EngineCore call
    sent cannot be taken back, so sent beside a swap that fails they would land after the abort
    (the old weights under the new label, their cached prefixes dropped).
    If a worker fails, the engine's weights may be part new: every request held here is dropped
    (the front holds the engine out, stale). An engine its caller paused stays paused."""
    engine = request.app[ENGINE_CLIENT]
    body = parse_json_object(await request.read())
    paused_here = not await engine.is_paused()
    if paused_here:
        await pause(engine, "keep", clear_cache=False)
    try:
        swapped = await on_every_worker(engine, SWAP_STAGED_RPC)
        await asyncio.gather(
            engine.update_weight_version(body["weight_version"]), _after_new_weights(request, engine, body.get("kv"))
        )
    except Exception:
        await abort(engine)
        raise
    finally:
        if paused_here:
            await engine.resume_generation()
    return json_response(
        {
            "status": "swapped",
            "tensors": sum(a["tensors"] for a in swapped),
            "installed": swapped[0]["installed"],
            "weight_version": body["weight_version"],
        }
    )


async def drop_staged(request: web.Request) -> web.Response:
    """Throw every worker's staging copy away; the live weights are untouched."""
    dropped = await on_every_worker(request.app[ENGINE_CLIENT], DROP_STAGED_RPC)
    return json_response({"status": "dropped", "workers": sum(answer["dropped"] for answer in dropped)})


async def load_checkpoint(request: web.Request) -> web.Response:
    """Inside a weight update, every worker loads the checkpoint on disk (POST /reload_weights)."""
    loaded = await on_every_worker(request.app[ENGINE_CLIENT], LOAD_CHECKPOINT_RPC)
    return json_response({"status": "loaded", "tensors": loaded})


async def abort_weight_update(request: web.Request) -> web.Response:
    """End an update that will not finish: drop every request held here, which would otherwise go
    on with weights no push finished (first: vLLM ends them at once, even while its EngineCore is
    still inside a broken transfer), close vLLM's layerwise reload (layers that received nothing
    keep their old tensors), and drop every cached prefix."""
    engine = request.app[ENGINE_CLIENT]
    aborted = await abort(engine)
    await on_every_worker(engine, END_WEIGHT_UPDATE_RPC)
    await engine.reset_prefix_cache(reset_running_requests=True)
    return json_response({"status": "aborted", "requests_aborted": aborted})


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_CLIENT]
    await engine.update_weight_version(parse_json_object(await request.read())["new_version"])
    return json_response({"status": "relabelled", "weight_version": await engine.get_weight_version()})


async def export_weights(request: web.Request) -> web.Response:
    """A peer catch-up's first half (weights/catchup.py): every worker writes what it serves with
    into its shared-memory file, ``prefix`` and its rank, and answers vLLM's checksums of it."""
    engine = request.app[ENGINE_CLIENT]
    prefix = parse_json_object(await request.read())["prefix"]
    answers = await on_every_worker(engine, EXPORT_WEIGHTS_RPC, prefix)
    checksums: dict[str, str] = {}
    for answer in answers:
        checksums.update(answer["checksums"])  # keys carry the worker's ranks
    return json_response(
        {
            "status": "exported",
            "weight_version": await engine.get_weight_version(),
            "workers": len(answers),
            "tensors": sum(answer["tensors"] for answer in answers),
            "bytes": sum(answer["bytes"] for answer in answers),
            "checksums": checksums,
        }
    )


async def import_weights(request: web.Request) -> web.Response:
    """A peer catch-up's second half: every worker copies the file its peer of the same rank wrote
    into its own tensors, in place (each refuses, touching nothing, unless every tensor matches).
    The front relabels the engine once its checksums are the peer's."""
    engine = request.app[ENGINE_CLIENT]
    prefix = parse_json_object(await request.read())["prefix"]
    answers = await on_every_worker(engine, IMPORT_WEIGHTS_RPC, prefix)
    # KV computed with the weights replaced must never be served again.
    await engine.reset_prefix_cache(reset_running_requests=True)
    return json_response(
        {"status": "imported", "workers": len(answers), "tensors": sum(answer["tensors"] for answer in answers)}
    )


async def shutdown_weight_transfer_engine(request: web.Request) -> web.Response:
    await request.app[ENGINE_CLIENT].shutdown_weight_transfer_engine()
    return json_response({"status": "left"})


def engine_call_route(handler):
    async def route(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"{request.path}: {exc}")
        except Exception as exc:
            log.exception("%s failed", request.path)
            return error_response(500, f"{request.path} failed in the engine: {exc}")

    return route


# Every weight route: its path (POST) and its handler.
_WEIGHT_ROUTES = {
    "/init_weight_transfer": init_weight_transfer,
    "/start_weight_update": start_weight_update,
    "/update_weights": update_weights,
    "/finish_weight_update": finish_weight_update,
    "/push": push,
    "/stage_weights": stage_weights,
    "/swap_staged": swap_staged,
    "/drop_staged": drop_staged,
    "/load_checkpoint": load_checkpoint,
    "/abort_weight_update": abort_weight_update,
    "/shutdown_weight_transfer_engine": shutdown_weight_transfer_engine,
    "/update_weight_version": update_weight_version,
    "/export_weights": export_weights,
    "/import_weights": import_weights,
}


def add_weight_routes(app: web.Application) -> None:
    for path, handler in _WEIGHT_ROUTES.items():
        app.router.add_post(path, engine_call_route(handler))
