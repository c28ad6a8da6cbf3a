"""Keys for what the engine's aiohttp app holds."""

from typing import Any

from aiohttp import web

ENGINE_CLIENT = web.AppKey("engine_client", Any)  # vLLM's AsyncLLM
SERVING_STATE = web.AppKey("serving_state", Any)  # what vLLM's init_app_state built
KV_EPOCHS = web.AppKey("kv_epochs", Any)  # weights.KvEpochs: which weights' KV a new request may reuse
SERVING_CALLS = web.AppKey("serving_calls", set)  # the serving routes' handler tasks running now
DATA_PARALLEL_SIZE = web.AppKey("data_parallel_size", int)  # the engine's data-parallel ranks
