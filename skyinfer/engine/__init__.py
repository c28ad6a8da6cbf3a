"""The engine child process: one vLLM AsyncLLM behind a small aiohttp app on a Unix socket,
with vLLM's own app behind that."""

# Named here (not imported from worker_extension, which imports vLLM) so the
# front can pass it to engines without importing vLLM itself.
EXTENSION_PATH = "skyinfer.engine.worker_extension.SkyinferWorkerExtension"
# vLLM's CPU worker without its seeded-chunked-prefill crash (cpu_worker.py says why).
CPU_WORKER_PATH = "skyinfer.engine.cpu_worker.SkyinferCPUWorker"
# On an answer whose request the engine could not finish because its EngineCore died:
# the request may be re-sent to another engine (the front does, once).
ENGINE_DIED_HEADER = "X-Skyinfer-Engine-Died"
# A request whose engine died after it generated tokens goes on on another engine
# (engine/continuation.py): the answer of the engine that died carries what it generated,
# a stream as its last chunk (an SSE comment starting so), any other answer as this field of its
# body (and the header says so); the front sends the request on with the same field added.
CONTINUE_MARKER = b": skyinfer-continue "
CONTINUE_FIELD = "skyinfer_continue"
CONTINUE_HEADER = "X-Skyinfer-Continue"
# The worker call that ends a weight update however it went (worker_extension.py).
END_WEIGHT_UPDATE_RPC = "skyinfer_end_weight_update"
# The worker call that loads the checkpoint on disk inside a weight update (POST /reload_weights).
LOAD_CHECKPOINT_RPC = "skyinfer_load_checkpoint"
# LoRA adapters: the worker call that receives a pushed adapter's tensors, and the
# file of PEFT's layout its config is written to.
RECEIVE_ADAPTER_RPC = "skyinfer_receive_adapter"
# The worker call that says how the last chunk of a weight update went (the receivers keep a
# failure rather than raise it: worker_calls.py says why).
RECEIVE_OUTCOME_RPC = "skyinfer_receive_outcome"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# Peer catch-up (weights/catchup.py): the worker calls that write and read one shared-memory file per worker.
EXPORT_WEIGHTS_RPC, IMPORT_WEIGHTS_RPC = "skyinfer_export_weights", "skyinfer_import_weights"
# Staged pushes (engine/staging.py): receive into a staging copy while generating, then swap it in or drop it.
STAGE_WEIGHTS_RPC, STAGING_STATUS_RPC = "skyinfer_stage_weights", "skyinfer_staging_status"
SWAP_STAGED_RPC, DROP_STAGED_RPC = "skyinfer_swap_staged", "skyinfer_drop_staged"
