"""Shared external data: every weight of a model stored once, in one file.

The whole rewritten graph and each of its segments point into the same weights.bin by
(offset, length), so a weight used by one segment is on disk once however it is cut.
Offsets are page-aligned so a runtime may map them instead of copying. A weight the
compiler left in the optimized model's own file (compiler/lazy_weights.py) is copied from
there, file to file.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import numpy_helper

from dspark.compiler.lazy_weights import read_raw

ALIGN = 4096
MIN_EXTERNAL_BYTES = 1024


def _raw(t: onnx.TensorProto) -> bytes:
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()


class WeightStore:
    """Appends tensors to one file, once per name, and rewrites protos to point into it."""

    def __init__(self, file: BinaryIO, location: str, source: Path | None = None):
        """`source`: the folder of the files external weights are read from (None: such
        weights stay where they are)."""
        self.file = file
        self.location = location
        self.source = source
        self.placed: dict[str, tuple[int, int]] = {}
        self.size = 0

    def _place(self, t: onnx.TensorProto) -> tuple[int, int]:
        if t.name not in self.placed:
            external = t.data_location == onnx.TensorProto.EXTERNAL
            data = read_raw(t, self.source) if external else _raw(t)
            pad = -self.size % ALIGN
            self.file.write(b"\0" * pad)
            self.file.write(data)
            self.placed[t.name] = (self.size + pad, len(data))
            self.size += pad + len(data)
        return self.placed[t.name]

    def externalize(self, model: onnx.ModelProto) -> int:
        """Move the model's large initializers into the store; returns how many moved."""
        return sum(self.externalize_one(t) for t in model.graph.initializer)

    def externalize_one(self, t: onnx.TensorProto) -> bool:
        """Move one initializer's data into the store (if large, or held in a `source` file);
        whether it moved."""
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if self.source is None:
                return False
        elif len(_raw(t)) < MIN_EXTERNAL_BYTES:
            return False
        offset, length = self._place(t)
        t.ClearField("raw_data")
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            t.ClearField(field)
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for key, value in (("location", self.location), ("offset", str(offset)),
                           ("length", str(length))):
            t.external_data.add(key=key, value=value)
        return True


def open_store(path: Path, source: Path | None = None) -> tuple[BinaryIO, WeightStore]:
    f = open(path, "wb")
    return f, WeightStore(f, path.name, source)
