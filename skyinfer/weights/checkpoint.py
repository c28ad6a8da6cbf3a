"""What a weight update may contain: the checkpoint's own tensor names and shapes.

Read from the safetensors headers of the served model (a few KB of JSON per
file, no tensor data), so bad metadata is refused before any byte moves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

from ..wire import UpdateMetadata


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from a safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


@attrs.frozen
class CheckpointSpec:
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def read(cls, model_dir: str | Path) -> CheckpointSpec | None:
        """The tensors of a local safetensors checkpoint, or None where there is none to read."""
        files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
        if not files:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            shapes.update(safetensors_shapes(path))
        config = Path(model_dir) / "config.json"
        if config.exists() and json.loads(config.read_text()).get("tie_word_embeddings"):
            # Tied models store no lm_head; trainers' state dicts still carry it.
            embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                shapes.setdefault("lm_head.weight", shapes[embed])
        return cls(shapes)

    def check(self, meta: UpdateMetadata, served_dtype: str) -> None:
        """Raise ValueError naming the first tensor that does not fit the served model."""
        for name, dtype, shape in zip(meta.names, meta.dtype_names, meta.shapes):
            expected = self.shapes.get(name)
            if expected is None:
                raise ValueError(f"unknown tensor {name!r}: the served checkpoint has no tensor of that name")
            if tuple(shape) != expected:
                raise ValueError(f"wrong shape for {name!r}: got {shape}, the model has {list(expected)}")
            if dtype != served_dtype:
                raise ValueError(
                    f"wrong dtype for {name!r}: got {dtype}, the engines serve {served_dtype}; send {served_dtype} tensors"
                )
