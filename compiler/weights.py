"""Shared external data: every weight of a model stored once, in one file.

The whole rewritten graph and each of its segments point into the same weights.bin by
(offset, length), so a weight used by one segment is on disk once however it is cut.
Offsets are page-aligned so a runtime may map them instead of copying.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import numpy_helper

ALIGN = 4096
MIN_EXTERNAL_BYTES = 1024


def _raw(t: onnx.TensorProto) -> bytes:
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()


class WeightStore:
    """Appends tensors to one file, once per name, and rewrites protos to point into it."""

    def __init__(self, file: BinaryIO, location: str):
        self.file = file
        self.location = location
        self.placed: dict[str, tuple[int, int]] = {}
        self.size = 0

    def _place(self, t: onnx.TensorProto) -> tuple[int, int]:
        if t.name not in self.placed:
            data = _raw(t)
            pad = -self.size % ALIGN
            self.file.write(b"\0" * pad)
            self.file.write(data)
            self.placed[t.name] = (self.size + pad, len(data))
            self.size += pad + len(data)
        return self.placed[t.name]

    def externalize(self, model: onnx.ModelProto) -> int:
        """Move the model's large initializers into the store; returns how many moved."""
        moved = 0
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            if len(_raw(t)) < MIN_EXTERNAL_BYTES:
                continue
            offset, length = self._place(t)
            t.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                t.ClearField(field)
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", self.location), ("offset", str(offset)),
                               ("length", str(length))):
                t.external_data.add(key=key, value=value)
            moved += 1
        return moved


def open_store(path: Path) -> tuple[BinaryIO, WeightStore]:
    f = open(path, "wb")
    return f, WeightStore(f, path.name)
