"""What a weight update may contain: the checkpoint's own tensor names and shapes.

Read from the safetensors headers of the served model (a few KB of JSON per
file, no tensor data), so bad metadata is refused before any byte moves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs


@attrs.frozen
class UpdateMetadata:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @classmethod
    def from_update_info(cls, info) -> UpdateMetadata:
        if not isinstance(info, dict):
            raise ValueError("update_info must be an object with names, dtype_names and shapes")
        try:
            names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        except KeyError as exc:
            raise ValueError(f"update_info is missing {exc.args[0]!r}") from None
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("update_info names, dtype_names and shapes must be lists")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes"
            )
        if not names:
            raise ValueError("update_info names no tensors")
        for name, dtype, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise ValueError(f"bad entry {name!r}: names and dtype_names must be strings")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"bad shape for {name!r}: {shape!r}")
        if len(set(names)) != len(names):
            raise ValueError("update_info names a tensor twice")
        return cls(names, dtypes, shapes)


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
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(entry["shape"])
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
