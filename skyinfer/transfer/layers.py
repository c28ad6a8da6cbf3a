"""Which of a checkpoint's tensors vLLM holds in one layer: a mixture-of-experts layer's experts
(one tensor per expert in the checkpoint, one packed tensor in vLLM), a fused projection's parts
(q, k and v in ``qkv_proj``), a weight and its scale. The front refuses a push of part of a layer
it cannot serve in part (weights/checkpoint.py); a worker reloads whole each layer a delta touched
(transfer/delta.py). Names only: importable by both, without vLLM."""

from __future__ import annotations

import re

__all__ = ["experts_layer_of", "layer_of", "module_of", "projection_layer_of"]

# A routed expert's tensor, as mixture-of-experts checkpoints name them: the layer's experts, the
# expert's index, the tensor (``model.layers.0.mlp.experts.3.gate_proj.weight``).
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.")

# The checkpoint's projections vLLM loads into one layer (its models' packed_modules_mapping).
_FUSED_PROJECTIONS = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}  # fmt: skip


def module_of(name: str) -> str:
    return name.rpartition(".")[0]


def experts_layer_of(name: str) -> str | None:
    """The experts layer a routed expert's tensor belongs to; None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    return match["experts"] if match is not None else None


def projection_layer_of(module: str) -> str:
    """The layer vLLM holds a checkpoint module in (q, k and v in ``qkv_proj``)."""
    parent, _, projection = module.rpartition(".")
    return f"{parent}.{_FUSED_PROJECTIONS.get(projection, projection)}"


def layer_of(name: str) -> str:
    """The layer vLLM holds a checkpoint tensor in."""
    return experts_layer_of(name) or projection_layer_of(module_of(name))
