"""The engine child process: one vLLM AsyncLLM behind a small aiohttp app on a Unix socket,
with vLLM's own app behind that.

What the front shares with it (its class paths, its answers' headers and markers, the adapter
files) is in ``skyinfer/engine_wire.py``; the names here are the engine's own worker calls."""

# The worker call that ends a weight update however it went (worker_extension.py).
END_WEIGHT_UPDATE_RPC = "skyinfer_end_weight_update"
# The worker call that loads the checkpoint on disk inside a weight update (POST /reload_weights).
LOAD_CHECKPOINT_RPC = "skyinfer_load_checkpoint"
# LoRA adapters: the worker call that receives a pushed adapter's tensors.
RECEIVE_ADAPTER_RPC = "skyinfer_receive_adapter"
# The worker call that says how the last chunk, or the finish, of a weight update went (the
# receivers keep a failure rather than raise it: worker_calls.py says why).
UPDATE_OUTCOME_RPC = "skyinfer_update_outcome"
# The worker call that makes a whole push (start, its one chunk, finish) in one call (POST /push).
PUSH_RPC = "skyinfer_push"
# Peer catch-up (weights/catchup.py): the worker calls that write and read one shared-memory file per worker.
EXPORT_WEIGHTS_RPC, IMPORT_WEIGHTS_RPC = "skyinfer_export_weights", "skyinfer_import_weights"
# Staged pushes (engine/staging.py): receive into a staging copy while generating, then swap it in or drop it.
STAGE_WEIGHTS_RPC, STAGING_STATUS_RPC = "skyinfer_stage_weights", "skyinfer_staging_status"
SWAP_STAGED_RPC, DROP_STAGED_RPC = "skyinfer_swap_staged", "skyinfer_drop_staged"
# After a push's finish: the memory it freed goes back to the kernel (and the GPU).
GIVE_BACK_MEMORY_RPC = "skyinfer_give_back_memory"
