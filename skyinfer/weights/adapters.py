"""LoRA adapters across the fleet: every engine holds the fleet's adapters at the fleet's versions
(an engine that could not load one is not routed its requests).

Routes follow vLLM's (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``),
plus ``/update_lora_adapter``: an adapter's tensors pushed over the trainer's
weight-transfer group, with no shared disk. Every version of an adapter is a
directory of its own in the service's adapter store, never rewritten: engines
load it from there (a pushed one is written there by each engine itself), a
restarted engine reloads the fleet's versions from there before it serves,
and since vLLM's prefix-cache keys include an adapter's path, a new version
never meets blocks computed with an older one, with no cache reset.

A change is all-or-nothing: an adapter is checked against the served model
before any engine sees it, its requests wait while it changes, and if some
engine fails to take it, the others are put back as they were (one that
cannot be is restarted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ..engine_wire import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from ..errors import ApiError, admin_json_body, json_response
from ..fleet.engine_calls import EngineReply, call_engine, failure
from ..fleet.registry import Adapter, EngineRegistry
from ..fleet.state import EngineRecord
from ..transfer.protocol import UpdateMetadata
from ..wire import LoadAdapterRequest, PushAdapterRequest, UnloadAdapterRequest, takes
from .checkpoint import CheckpointSpec, safetensors_shapes
from .sync import SyncError, WeightSync

log = logging.getLogger("skyinfer.adapters")

# PEFT's tensor names: [base_model.model.]<module>.lora_A|lora_B[.<adapter name>].weight
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


class AdapterError(ApiError):
    """An adapter that cannot be served: refused before any engine sees it."""


class AdapterNotFound(ApiError):
    status = 404


def check_adapter(config: dict, shapes: dict[str, tuple[int, ...]], base: CheckpointSpec | None, max_rank: int) -> None:
    """Raise AdapterError naming the first thing about a PEFT LoRA adapter the served model cannot take."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r}: only LoRA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter config 'r' must be a positive integer, not {rank!r}")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported by vLLM")
    if not shapes:
        raise AdapterError("the adapter has no tensors")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = _LORA_TENSOR.match(name)
        if match is None:
            raise AdapterError(f"tensor {name!r} is not a LoRA A or B matrix (PEFT's <module>.lora_A.weight)")
        pairs.setdefault(match["module"], {})[match["kind"]] = shape
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"module {module!r} has {', '.join(pair)} but not both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterError(f"module {module!r}: lora_A {list(a)} and lora_B {list(b)} are not a rank-r pair")
        if a[0] > max_rank:
            raise AdapterError(
                f"module {module!r} has rank {a[0]}; the engines take at most --max-lora-rank {max_rank}"
            )
        if a[0] != rank and not config.get("rank_pattern"):
            raise AdapterError(f"module {module!r} has rank {a[0]} but the adapter config says r={rank}")
        if base is None:
            continue
        weight = base.shapes.get(f"{module}.weight")
        if weight is None:
            raise AdapterError(f"the adapter targets module {module!r}, which the served model does not have")
        out_features, in_features = weight
        if a[1] != in_features or b[0] != out_features:
            raise AdapterError(
                f"module {module!r}: lora_A {list(a)} and lora_B {list(b)} do not fit its weight "
                f"[{out_features}, {in_features}] (expected [r, {in_features}] and [{out_features}, r])"
            )


def _read_adapter_dir(path: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    directory = Path(path)
    try:
        is_directory = directory.is_dir()
    except (OSError, ValueError) as exc:  # a name too long, a NUL in it
        raise AdapterError(f"lora_path {path[:200]!r} is not a usable path: {exc}", param="lora_path") from None
    if not is_directory:
        raise AdapterError(f"lora_path {path[:200]!r} does not exist or is not a directory", param="lora_path")
    weights = directory / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "nothing"
        raise AdapterError(
            f"lora_path {path!r} has no {ADAPTER_WEIGHTS_FILE} (found: {found}); adapters are loaded from "
            "safetensors only, never from pickled .bin files",
            param="lora_path",
        )
    try:
        config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
        shapes = safetensors_shapes(weights)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"lora_path {path!r} is not a readable PEFT adapter: {exc}", param="lora_path") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG_FILE} in {path!r} is not a JSON object", param="lora_path")
    return config, shapes


def _copy_adapter(source: str, destination: str) -> None:
    os.makedirs(destination)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))


class AdapterFleet:
    def __init__(
        self,
        registry: EngineRegistry,
        sync: WeightSync,
        model: str,
        store: str,
        timeout_s: float,
        restart: Callable[[EngineRecord, str], None],
    ):
        self.registry = registry
        self.sync = sync
        # For an engine whose adapters are unknown (a call to it timed out, or a rollback failed):
        # its next process starts with none and takes the fleet's (``restore``).
        self._restart = restart
        self.model = model
        self.store = store
        self.timeout_s = timeout_s
        self._base = CheckpointSpec.read(model)
        # What the fleet serves lives in the registry, which routes by it.
        self.adapters = registry.fleet_adapters

    def _max_rank(self, engines: list[EngineRecord]) -> int:
        ranks = {r.max_lora_rank for r in engines}
        if None in ranks or not ranks:
            raise ApiError(
                "the engines serve no LoRA adapters: start skyinfer with --enable-lora (and --max-lora-rank)",
                status=400,
            )
        return min(ranks)

    def _targets(self, name: str, load_inplace: bool) -> list[EngineRecord]:
        if name == self.model:
            raise AdapterError(f"lora_name {name!r} is the served base model's name", param="lora_name")
        if name in self.adapters and not load_inplace:
            raise AdapterError(
                f"the lora adapter {name!r} has already been loaded; set load_inplace to reload it", param="lora_name"
            )
        engines = self.registry.up()
        if not engines:
            raise ApiError("no engine is up", status=503)
        return engines

    def _new_directory(self) -> str:
        return os.path.join(self.store, uuid.uuid4().hex)

    # -- load, push, unload ------------------------------------------------------
    async def load(self, request: LoadAdapterRequest) -> dict:
        """Load an adapter from a directory on every engine (vLLM's body, plus ``version``), or
        reload it in place; checked against the checkpoint first, rolled back if an engine fails.

        If its caller leaves: the load still lands on every engine, or is rolled back on all."""
        async with self.registry.fleet_change():
            engines = self._targets(request.lora_name, request.load_inplace)
            config, shapes = await asyncio.to_thread(_read_adapter_dir, request.lora_path)
            check_adapter(config, shapes, self._base, self._max_rank(engines))
            # The fleet's own copy: every engine loads the same bytes, now and after a restart.
            directory = self._new_directory()
            await asyncio.to_thread(_copy_adapter, request.lora_path, directory)
            paths = {r.engine_id: directory for r in engines}
            return await self._install(request.lora_name, request.version, directory, paths, engines)

    async def push(self, request: PushAdapterRequest) -> dict:
        """Receive the adapter's tensors on every engine (a collective with the trainer's
        broadcast), then load it everywhere. A failed receive touches no model weights:
        the fleet keeps what it served, and the trainer's group must be formed again.

        If its caller leaves: as a load, it lands on every engine or on none."""
        meta = UpdateMetadata.parse(request.update_info, ("update_info",))
        async with self.registry.fleet_change():
            engines = self.sync.transfer_members()
            self._targets(request.lora_name, load_inplace=True)
            shapes = {name: tuple(shape) for name, shape in zip(meta.names, meta.shapes)}
            try:
                check_adapter(request.peft_config, shapes, self._base, self._max_rank(engines))
            except AdapterError as exc:
                raise AdapterError(f"adapter rejected before any transfer: {exc}") from None
            if request.check_only:
                return {"status": "checked", "lora_name": request.lora_name}
            directory = self._new_directory()
            paths = {r.engine_id: os.path.join(directory, f"engine-{r.engine_id}") for r in engines}
            body = {"peft_config": request.peft_config, "update_info": request.update_info}
            replies = await asyncio.gather(
                *(
                    call_engine(
                        r, "/adapters/receive", timeout_s=self.timeout_s, body={**body, "directory": paths[r.engine_id]}
                    )
                    for r in engines
                )
            )
            failed = failure("receiving the adapter", replies)
            if failed is not None:
                self.sync.group_broken(failed[1])
                # One that gave no answer may still be inside the collective, its EngineCore blocked.
                self._restart_unanswered(engines, replies, "receiving an adapter")
                await asyncio.to_thread(shutil.rmtree, directory, True)
                raise SyncError(*failed, [rep.as_json() for rep in replies])
            return await self._install(request.lora_name, request.version, directory, paths, engines)

    async def _install(
        self, name: str, version: str | None, directory: str, paths: dict[int, str], engines: list[EngineRecord]
    ) -> dict:
        """Load a new version on every engine, or put every engine back as it was."""
        previous = self.adapters.get(name)
        revision = previous.revision + 1 if previous else 1
        adapter = Adapter(version or f"{name}-r{revision}", paths, directory, revision)
        with self.registry.changing_adapter(name):
            replies = await asyncio.gather(*(self._load_on(r, name, adapter) for r in engines))
            failed = failure(f"loading adapter {name!r}", replies)
            if failed is not None:
                self._restart_unanswered(engines, replies, f"loading adapter {name!r}")
                await self._roll_back(name, previous, [r for r, rep in zip(engines, replies) if rep.ok])
                await asyncio.to_thread(shutil.rmtree, directory, True)
                raise SyncError(
                    failed[0], failed[1] + "; every engine keeps what it had", [rep.as_json() for rep in replies]
                )
            self.adapters[name] = adapter
            self.registry.unloaded_adapters.discard(name)
        if previous is not None:
            await asyncio.to_thread(shutil.rmtree, previous.directory, True)
        log.info("adapter %s at version %s on %d engine(s)", name, adapter.version, len(engines))
        return {
            "status": "loaded",
            "lora_name": name,
            "version": adapter.version,
            "engines": [rep.as_json() for rep in replies],
        }

    async def _load_on(self, record: EngineRecord, name: str, adapter: Adapter) -> EngineReply:
        reply = await call_engine(
            record,
            "/adapters/load",
            timeout_s=self.timeout_s,
            body={"lora_name": name, "lora_path": adapter.path_for(record.engine_id)},
        )
        if reply.ok:
            record.hold_adapter(name, adapter.version)
        return reply

    async def _roll_back(self, name: str, previous: Adapter | None, loaded: list[EngineRecord]) -> None:
        """Engines that took the new version go back to the old one (or lose the name); one that
        cannot is never routed the adapter again until a load succeeds on it."""
        for record in loaded:
            record.drop_adapter(name)
        if previous is None:
            replies = await asyncio.gather(*(self._unload_on(r, name) for r in loaded))
        else:
            replies = await asyncio.gather(*(self._load_on(r, name, previous) for r in loaded))
        for record, reply in zip(loaded, replies):
            if not reply.ok and record.up:
                self._restart(record, f"rolling adapter {name!r} back failed: {reply.message}")

    def _restart_unanswered(self, engines: list[EngineRecord], replies: list[EngineReply], step: str) -> None:
        """An engine that did not answer (timeout, connection lost) may have done the step or not."""
        for record, reply in zip(engines, replies):
            if reply.status in (503, 504) and record.up:
                self._restart(record, f"{step} got no answer: {reply.message}")

    async def _unload_on(self, record: EngineRecord, name: str) -> EngineReply:
        record.drop_adapter(name)
        return await call_engine(record, "/adapters/unload", timeout_s=self.timeout_s, body={"lora_name": name})

    async def unload(self, request: UnloadAdapterRequest) -> dict:
        """Take an adapter out of routing, then off every engine.

        If its caller leaves: it still leaves every engine."""
        async with self.registry.fleet_change():
            # Out of routing first: no request is sent to an adapter on its way out.
            adapter = self.adapters.pop(request.lora_name, None)
            if adapter is None:
                raise AdapterNotFound(f"the lora adapter {request.lora_name!r} cannot be found", param="lora_name")
            self.registry.unloaded_adapters.add(request.lora_name)
            engines = self.registry.up()
            replies = await asyncio.gather(*(self._unload_on(r, request.lora_name) for r in engines))
        await asyncio.to_thread(shutil.rmtree, adapter.directory, True)
        failed = failure(f"unloading adapter {request.lora_name!r}", replies)
        if failed is None:
            # Every engine dropped it and answers 404 itself: the front need not read request bodies for it.
            self.registry.unloaded_adapters.discard(request.lora_name)
        else:
            # The fleet no longer serves the name; an engine that may still hold it starts afresh.
            for record, reply in zip(engines, replies):
                if not reply.ok and record.up:
                    self._restart(record, f"unloading adapter {request.lora_name!r} failed: {reply.message}")
            raise SyncError(*failed, [rep.as_json() for rep in replies])
        return {"status": "unloaded", "lora_name": request.lora_name, "engines": [rep.as_json() for rep in replies]}

    async def restore(self, record: EngineRecord) -> None:
        """An engine process being brought up takes the fleet's adapters, at the fleet's versions,
        before it serves (bringup.py); one it cannot load is never routed to it."""
        for name in [name for name in record.adapters if name not in self.adapters]:
            await self._unload_on(record, name)  # unloaded from the fleet while it was brought up
        for name, adapter in list(self.adapters.items()):
            if record.adapters.get(name) == adapter.version:
                continue
            reply = await self._load_on(record, name, adapter)
            if not reply.ok:
                log.error("engine %d: restoring adapter %s failed: %s", record.engine_id, name, reply.message)


ADAPTERS = web.AppKey("adapters", AdapterFleet)


def _route(request_type, call):
    @takes(request_type)
    async def route(request: web.Request) -> web.Response:
        body = request_type.parse(await admin_json_body(request) or {})
        # A caller that goes away does not leave engines half-changed: admin calls run to their end (abandoning.py).
        return json_response(await call(request.app[ADAPTERS], body))

    route.__doc__ = call.__doc__
    return route


def add_adapter_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", _route(LoadAdapterRequest, AdapterFleet.load))
    app.router.add_post("/v1/unload_lora_adapter", _route(UnloadAdapterRequest, AdapterFleet.unload))
    app.router.add_post("/update_lora_adapter", _route(PushAdapterRequest, AdapterFleet.push))
