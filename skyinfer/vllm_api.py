"""Every vLLM name skyinfer uses, in one table (``NAMES``), each with the modules it lives in across
the known vLLM releases; ``from skyinfer.vllm_api import build_app`` looks a name up on first use.
It imports nothing from skyinfer, so every layer (``transfer/``, ``engine/``) may import it."""

from __future__ import annotations

import importlib
from typing import Any

# The table; the vLLM names themselves are looked up on first use (``__getattr__``), so a star
# import, which would import every one of them, takes the table alone.
__all__ = ["KNOWN_VERSIONS", "NAMES"]

# Releases the table is checked against (tools/check_vllm_api.py); setup.cfg's vLLM range admits these.
KNOWN_VERSIONS = ("0.32.0", "0.33.0")

_CLI_ARGS = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")  # 0.33 moved it
_TRANSFER_BASE = ("vllm.distributed.weight_transfer.base",)

# name -> modules that may define it, newest vLLM first. skyinfer imports vLLM only through this
# table; a process imports only the modules of the names it uses (a worker loads the weight-transfer
# names, never the HTTP stack). tools/check_vllm_api.py checks the table against each release in
# KNOWN_VERSIONS from its source, without installing it; CI runs it on every change.
NAMES: dict[str, tuple[str, ...]] = {
    # Engine start-up: `vllm serve`'s own argument parser, environment and logging.
    "make_arg_parser": _CLI_ARGS,
    "validate_parsed_serve_args": _CLI_ARGS,
    "FlexibleArgumentParser": ("vllm.utils.argparse_utils",),
    "cli_env_setup": ("vllm.entrypoints.common.startup", "vllm.entrypoints.serve.utils.api_utils"),  # moved in 0.33
    "configure_logging_from_args": ("vllm.logger",),
    # The engine and vLLM's app: what `vllm serve` itself builds.
    "build_async_engine_client": ("vllm.entrypoints.launchers.api_server.entry",),
    "build_app": ("vllm.entrypoints.launchers.app",),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state",),
    # vLLM's routes for a pooling model (tests/test_vllm_surface.py builds that app without an engine).
    "ModelConfig": ("vllm.config",),
    # The routes the engine serves natively (the hot path): vLLM's request types and error mapping.
    "ChatCompletionRequest": ("vllm.entrypoints.openai.chat_completion.protocol",),
    "CompletionRequest": ("vllm.entrypoints.openai.completion.protocol",),
    "GenerateRequest": ("vllm.entrypoints.scale_out.token_in_token_out.protocol",),
    "TokenizeRequest": ("vllm.entrypoints.serve.tokenize.protocol",),
    "DetokenizeRequest": ("vllm.entrypoints.serve.tokenize.protocol",),
    "ErrorResponse": ("vllm.entrypoints.serve.engine.protocol",),
    "create_error_response": ("vllm.entrypoints.serve.exception_handling.error_response",),
    # Weight transfer: the backend interface skyinfer's backends implement (engine/backends.py), and its registry.
    "WeightTransferEngine": _TRANSFER_BASE,
    "WeightTransferInitInfo": _TRANSFER_BASE,
    "WeightTransferUpdateInfo": _TRANSFER_BASE,
    "WeightTransferInitRequest": _TRANSFER_BASE,
    "WeightTransferUpdateRequest": _TRANSFER_BASE,
    "WeightTransferEngineFactory": ("vllm.distributed.weight_transfer.factory",),
    # vLLM's NCCL rendezvous and communicator, which skyinfer's NCCL receiver joins with (transfer/nccl.py).
    "StatelessProcessGroup": ("vllm.distributed.utils",),
    "PyNcclCommunicator": ("vllm.distributed.device_communicators.pynccl",),
    "unpinned_nccl_env": ("vllm.utils.nccl",),
    "stateless_init_torch_distributed_process_group": ("vllm.distributed.utils",),
    "stateless_destroy_torch_distributed_process_group": ("vllm.distributed.utils",),
    # The CPU worker skyinfer's own CPU worker class extends (engine/cpu_worker.py).
    "CPUWorker": ("vllm.v1.worker.cpu_worker",),
    # vLLM's CPU platform, which a CPU engine of one worker extends to fork its EngineCore
    # (engine/cpu_platform.py), and what chooses the platform of a process.
    "CpuPlatform": ("vllm.platforms.cpu",),
    "resolve_current_platform_cls_qualname": ("vllm.platforms",),
    # What a CPU worker's message queue spins on after each message read (engine/cpu_setup.py shortens it).
    "SpinCondition": ("vllm.distributed.device_communicators.shm_broadcast",),
    # How a CPU linear layer packs its weight for its kernel (engine/cpu_setup.py keeps the weight too).
    "dispatch_cpu_unquantized_gemm": ("vllm.model_executor.layers.utils",),
    # The CPU int8 W8A8 kernel, whose oneDNN handler reads the weight scales it was built with (engine/cpu_setup.py).
    "CPUInt8ScaledMMLinearKernel": ("vllm.model_executor.kernels.linear.scaled_mm.cpu",),
    # Whether that kernel takes SGLang's AMX path for a layer (bfloat16 or float16 activations only):
    # the suite checks skyinfer's own reading of it (cpu_support.py) against it, on whichever CPU it runs.
    "check_cpu_sgl_kernel": ("vllm.model_executor.layers.utils",),
    # How that kernel quantizes a layer's input to int8 (engine/cpu_setup.py computes with it where oneDNN saturates).
    "onednn_scaled_int8_quant": ("vllm._custom_ops",),
    # What loads a parameter whose layer names no loader of its own (a staged push's shadow, engine/targets.py).
    "default_weight_loader": ("vllm.model_executor.model_loader.weight_utils",),
    "initialize_layerwise_reload": ("vllm.model_executor.model_loader.reload",),
    # What a reload reads and does of a layer: its shapes as created (before processing packed them)
    # and the count of elements a loader wrote (a staged push's shadow of a CPU MoE layer, engine/targets.py).
    "get_layerwise_info": ("vllm.model_executor.model_loader.reload.layerwise",),
    "CopyCounter": ("vllm.model_executor.model_loader.reload.meta",),
    # Mixture-of-experts layers whose CPU kernel packs the experts (transfer/receiving.py).
    "UnquantizedFusedMoEMethod": ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",),
    "set_current_vllm_config": ("vllm.config",),
    "finalize_layerwise_reload": ("vllm.model_executor.model_loader.reload",),
    # A layer a push filled in part is materialized from what it serves before the reload's finish
    # processes it (transfer/receiving.py): which layers serve their weights as loaded, and how.
    "materialize_layer": ("vllm.model_executor.model_loader.reload.meta",),
    "is_deferred_attention_layer": ("vllm.model_executor.layers.attention",),
    "UnquantizedLinearMethod": ("vllm.model_executor.layers.linear",),
    "UnquantizedEmbeddingMethod": ("vllm.model_executor.layers.vocab_parallel_embedding",),
    # The loader that read the checkpoint at start-up: a reload from disk reads it again.
    "get_model_loader": ("vllm.model_executor.model_loader",),
    # A request that goes on on another engine (engine/continuation.py): what generate takes and gives.
    "SamplingParams": ("vllm.sampling_params",),
    "RequestOutputKind": ("vllm.sampling_params",),
    "RequestOutput": ("vllm.outputs",),
    "CompletionOutput": ("vllm.outputs",),
    "WeightVersionSpan": ("vllm.outputs",),
    "Logprob": ("vllm.logprobs",),
    "merge_async_iterators": ("vllm.utils.async_utils",),
    # The engine's client: its call_utility_all_async asks every data-parallel rank's EngineCore and
    # returns each one's answer (engine/worker_calls.py); AsyncLLM.collective_rpc returns the first's.
    "AsyncMPClient": ("vllm.v1.engine.core_client",),
    # LoRA: the request an adapter is loaded and served with.
    "LoRARequest": ("vllm.lora.request",),
}


def __getattr__(name: str) -> Any:
    modules = NAMES.get(name)
    if modules is None:
        raise AttributeError(f"{__name__} has no {name!r}: add it to NAMES")
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # the module exists but one of its own imports failed
            continue
        if hasattr(module, name):
            value = getattr(module, name)
            globals()[name] = value
            return value
    import vllm

    raise ImportError(
        f"vLLM {vllm.__version__} has {name} in none of {', '.join(modules)}; "
        f"skyinfer is known to work with vLLM {', '.join(KNOWN_VERSIONS)}"
    )
