"""Engine-side LoRA routes: load, unload and receive an adapter on this engine's AsyncLLM. The front
decides what every engine holds (versions, directories, rollback); these carry one call out."""

from __future__ import annotations

import json
import os

from aiohttp import web

from ..engine_wire import ADAPTER_CONFIG_FILE
from ..errors import json_response, parse_json_object
from . import RECEIVE_ADAPTER_RPC
from .appkeys import ENGINE_CLIENT, SERVING_STATE
from .weights import engine_call_route
from .worker_calls import on_every_worker

__all__ = ["add_adapter_routes"]


async def _load(request: web.Request) -> web.Response:
    from ..vllm_api import LoRARequest

    body = parse_json_object(await request.read())
    name, path = body["lora_name"], body["lora_path"]
    models = request.app[SERVING_STATE].openai_serving_models
    previous = models.lora_requests.get(name)
    lora_id = previous.lora_int_id if previous is not None else models.lora_id_counter.inc(1)
    # vLLM loads the new weights before it drops the old: a load that fails leaves the old adapter serving.
    # Loaded in place once; the request that serves traffic carries no load_inplace flag, for vLLM's
    # workers reload an adapter from disk whenever a request carries it (vLLM #33791), and vLLM's own
    # /v1/load_lora_adapter keeps the request it loaded with, the flag included.
    await request.app[ENGINE_CLIENT].add_lora(
        LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=True)
    )
    models.lora_requests[name] = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
    return json_response({"status": "loaded", "lora_name": name, "lora_int_id": lora_id})


async def _unload(request: web.Request) -> web.Response:
    name = parse_json_object(await request.read())["lora_name"]
    loaded = request.app[SERVING_STATE].openai_serving_models.lora_requests.pop(name, None)
    if loaded is None:
        return json_response({"status": "absent", "lora_name": name})
    await request.app[ENGINE_CLIENT].remove_lora(loaded.lora_int_id)
    return json_response({"status": "unloaded", "lora_name": name})


async def _receive(request: web.Request) -> web.Response:
    """Receive an adapter's tensors from the trainer's group into ``directory``, with its PEFT config."""
    body = parse_json_object(await request.read())
    directory = body["directory"]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(body["peft_config"], f)
    per_worker = await on_every_worker(request.app[ENGINE_CLIENT], RECEIVE_ADAPTER_RPC, body["update_info"], directory)
    return json_response({"status": "received", "tensors": per_worker[0]["tensors"]})


def add_adapter_routes(app: web.Application) -> None:
    app.router.add_post("/adapters/load", engine_call_route(_load))
    app.router.add_post("/adapters/unload", engine_call_route(_unload))
    app.router.add_post("/adapters/receive", engine_call_route(_receive))
