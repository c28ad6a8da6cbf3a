"""What a weight update may contain: the checkpoint's own tensor names, shapes and kinds of dtype.

Read from the safetensors headers of the served model (a few KB of JSON per
file, no tensor data), so bad metadata is refused before any byte moves.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import attrs

from ..transfer.layers import experts_layer_of, module_of, projection_layer_of
from ..transfer.protocol import FLOATING, UpdateMetadata
from ..transfer.quantize import SCALE_SUFFIX, W8A8_INT8, is_w8a8_int8

# safetensors' dtype names, as vLLM's dtype_names spell them.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip


def safetensors_header(path: str | Path) -> dict[str, dict]:
    """Each tensor's header entry (dtype, shape, offsets), from a safetensors file (no tensor data is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from a safetensors file's header."""
    return {name: tuple(entry["shape"]) for name, entry in safetensors_header(path).items()}


def _by_expert_layer(names: Iterable[str]) -> dict[str, set[str]]:
    layers: dict[str, set[str]] = {}
    for name in names:
        if (experts := experts_layer_of(name)) is not None:
            layers.setdefault(experts, set()).add(name)
    return layers


def _by_quantized_layer(names: Iterable[str], quantized_modules: set[str]) -> dict[str, set[str]]:
    """The tensors of each quantized layer as vLLM holds it (q, k and v in one), by that layer."""
    layers: dict[str, set[str]] = {}
    for name in names:
        module = module_of(name)
        if module in quantized_modules:
            layers.setdefault(projection_layer_of(module), set()).add(name)
    return layers


def describe_quantization(spec: CheckpointSpec | None, online: str | None) -> dict | None:
    """What the engines serve quantized, and what a push must carry for it (``/weight_info``): None
    for full precision. ``online``: vLLM's ``--quantization`` on a full-precision checkpoint."""
    if online is not None:
        return {"method": online, "quantized_by": "each engine, as it loads a push", "push": "full precision"}
    config = spec.quantization if spec is not None else None
    if not config:
        return None
    return {
        "method": config.get("quant_method"),
        "format": config.get("format"),
        "quantized_by": "the trainer (the checkpoint stores quantized weights)",
        "push": "each quantized weight as the checkpoint stores it, with its scale",
        # The scheme skyinfer's trainer helpers quantize full-precision tensors to as they push, if they can.
        "trainer_scheme": W8A8_INT8 if is_w8a8_int8(config) else None,
    }


@attrs.frozen
class CheckpointSpec:
    shapes: dict[str, tuple[int, ...]]
    # As the checkpoint stores each tensor (vLLM's names); None where it is none vLLM knows.
    dtypes: dict[str, str | None]
    # The tensors the checkpoint stores (a tied lm_head, which it does not, is in ``shapes`` only).
    names: frozenset[str] = attrs.field(default=attrs.Factory(lambda spec: frozenset(spec.shapes), takes_self=True))
    # config.json's quantization_config: how the checkpoint stores its quantized weights (None: full precision).
    quantization: dict | None = None
    # The layers the engines serve quantized, by vLLM's names (``qkv_proj``), as they report them:
    # an online quantization's (``--quantization fp8`` on a full-precision checkpoint) too.
    served_quantized: frozenset[str] = frozenset()

    def missing(self, received: set[str]) -> list[str]:
        """The checkpoint's tensors a push did not carry (none: it replaced every weight)."""
        return sorted(self.names - received)

    @property
    def elements(self) -> int:
        """The elements of every tensor a push of the whole model carries (a tied lm_head included)."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    @classmethod
    def find(cls, model: str) -> CheckpointSpec | None:
        """The served checkpoint's tensors: ``model`` a local directory, or a hub id whose snapshot
        is in the local Hugging Face cache (where the engines downloaded it); None until then."""
        if Path(model).is_dir():
            return cls.read(model)
        try:
            from huggingface_hub import snapshot_download

            return cls.read(snapshot_download(model, local_files_only=True))
        except Exception:  # not a hub id, not downloaded (yet), no huggingface_hub: unknown for now
            return None

    @classmethod
    def read(cls, model_dir: str | Path) -> CheckpointSpec | None:
        """The tensors of a local safetensors checkpoint, or None where there is none to read."""
        files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
        if not files:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str | None] = {}
        for path in files:
            for name, entry in safetensors_header(path).items():
                shapes[name] = tuple(entry["shape"])
                dtypes[name] = _SAFETENSORS_DTYPES.get(entry["dtype"])
        stored = frozenset(shapes)
        config_file = Path(model_dir) / "config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        if config.get("tie_word_embeddings"):
            # Tied models store no lm_head; trainers' state dicts still carry it.
            embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                shapes.setdefault("lm_head.weight", shapes[embed])
                dtypes.setdefault("lm_head.weight", dtypes[embed])
        return cls(shapes, dtypes, stored, config.get("quantization_config"))

    @property
    def has_experts(self) -> bool:
        """Whether the model is a mixture of experts (it stores expert tensors)."""
        return bool(_by_expert_layer(self.names))

    @property
    def quantized_modules(self) -> set[str]:
        """The checkpoint's modules that are served quantized: those whose weight it stores quantized,
        with its scale (``<module>.weight_scale``), and those of a layer the engines report quantized."""
        stored = {name.rpartition(".")[0] for name in self.names if name.endswith(".weight" + SCALE_SUFFIX)}
        return stored | {
            module for module in map(module_of, self.names) if projection_layer_of(module) in self.served_quantized
        }

    def quantized_layer_shapes(self) -> dict[str, tuple[int, int]]:
        """Each quantized layer as vLLM holds it (q, k and v in one), and its weight's [out, in] shape."""
        weights = (name for name in self.names if name.endswith(".weight"))
        return {
            layer: (sum(self.shapes[name][0] for name in parts), self.shapes[min(parts)][1])
            for layer, parts in _by_quantized_layer(weights, self.quantized_modules).items()
        }

    def check_whole_layers(self, names: Iterable[str]) -> None:
        """Raise ValueError naming a layer the update carries part of, where the part left out could
        not be served as it is: vLLM reloads a mixture-of-experts layer or a quantized one whole,
        and what a push left out would be served from fresh memory (experts), or the layer refused
        at the finish (a weight without its scale, q without k and v in an int8 layer)."""
        names = set(names)
        quantized = self.quantized_modules
        for stored, pushed, what in (
            (_by_expert_layer(self.names), _by_expert_layer(names), "a mixture-of-experts layer takes a push of all its experts or of none"),
            (_by_quantized_layer(self.names, quantized), _by_quantized_layer(names, quantized), "a quantized layer takes a push of all its tensors (each weight with its scale) or of none"),
        ):  # fmt: skip
            for layer, carried in sorted(pushed.items()):
                missing = sorted(stored.get(layer, set()) - carried)
                if missing:
                    raise ValueError(
                        f"the update carries {len(carried)} of the {len(stored[layer])} tensors of {layer}"
                        f" ({missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} left out): {what}"
                    )

    def check(self, meta: UpdateMetadata) -> None:
        """Raise ValueError naming the first tensor that does not fit the served model.

        vLLM casts a floating tensor into the dtype it serves when it loads it (and several model
        families keep some tensors in float32), so any floating dtype fits a floating tensor;
        other tensors must come as the checkpoint stores them.
        """
        for name, dtype, shape in zip(meta.names, meta.dtype_names, meta.shapes):
            expected = self.shapes.get(name)
            if expected is None:
                raise ValueError(f"unknown tensor {name!r}: the served checkpoint has no tensor of that name")
            if tuple(shape) != expected:
                raise ValueError(f"wrong shape for {name!r}: got {shape}, the model has {list(expected)}")
            stored = self.dtypes.get(name)
            fits = dtype in FLOATING if stored in FLOATING else stored is None or dtype == stored
            if not fits:
                kind = "a floating-point dtype" if stored in FLOATING else stored
                raise ValueError(f"wrong dtype for {name!r}: got {dtype}, the checkpoint stores {stored}; send {kind}")
