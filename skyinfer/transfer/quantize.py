"""Int8 W8A8 as an int8 engine serves it (compressed-tensors' ``int-quantized`` format, which vLLM
loads): each linear layer's weight in int8 with one float32 scale per output channel, symmetric;
activations quantized per token by the engine as it runs. What a trainer holding full-precision
weights sends to such an engine (half of bf16's bytes, a quarter of float32's), and how the demo
model's int8 checkpoint is made offline; the same rounding in both, so that a push of the
checkpoint's own weights quantized here is the checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Imported where a tensor is quantized (a trainer, the demo's checkpoint): the front reads the
    # scheme's names and configs from here, and torch is most of its start-up and memory otherwise.
    import torch

# The decoder layers' linear projections (Qwen2's and Llama's names); embeddings, norms and the
# head stay in full precision, as llm-compressor leaves them by default.
LINEAR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE_SUFFIX = "_scale"

# config.json's quantization_config for such a checkpoint (compressed-tensors 0.x, as llm-compressor
# writes its W8A8 int8 scheme).
W8A8_INT8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


# The scheme's name where the server tells a trainer what to send (``/weight_info``'s quantization).
W8A8_INT8 = "w8a8_int8"


def is_w8a8_int8(quantization_config: dict) -> bool:
    """Whether a checkpoint's quantization_config is the scheme this module quantizes to: every
    quantized layer's weights int8, symmetric, one scale per output channel."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        return False
    groups = list(quantization_config.get("config_groups", {}).values())
    return bool(groups) and all(
        (weights := group.get("weights") or {}).get("num_bits") == 8
        and weights.get("type") == "int"
        and weights.get("symmetric")
        and weights.get("strategy") == "channel"
        for group in groups
    )


def is_quantized_linear(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is a weight W8A8 stores in int8."""
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_PROJECTIONS


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 and its float32 scales [out, 1]: round(w / s), s = max|w| / 127 per row."""
    import torch

    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_w8a8_int8(
    weights: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Named full-precision weights as an int8 W8A8 checkpoint names them: each floating linear
    weight in int8, followed by its ``<name>_scale``; every other tensor as it is (an int8 weight
    too: it comes with its scale)."""
    items = weights.items() if isinstance(weights, dict) else weights
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        if is_quantized_linear(name) and tensor.is_floating_point():  # int8 already: sent as it is
            q, scale = int8_per_channel(tensor)
            out += [(name, q), (name + SCALE_SUFFIX, scale)]
        else:
            out.append((name, tensor))
    return out
