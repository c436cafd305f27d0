"""Weights left in their file while the compiler rewrites the graph around them.

The optimized model's weights stay in the external file onnxruntime wrote into the work
folder; the graph the passes rewrite holds references to them. A pass that reads a weight's
values reads it from the file then and lets it go; a session a pass builds on a piece of
the graph gets that piece's weights read in (inline_weights); the bundle writer copies each
weight file to file, once (weights.WeightStore). So the compiler holds the graph and one
weight at a time, never the model twice (docs/benchmarks.md, "At 1B parameters").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

EXTERNAL = onnx.TensorProto.EXTERNAL


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def read_raw(tensor: onnx.TensorProto, folder: Path) -> bytes:
    """An external tensor's bytes as stored, from its file under `folder`."""
    info = external_info(tensor)
    path = Path(folder) / info["location"]
    with open(path, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        length = info.get("length")
        data = f.read(int(length)) if length is not None else f.read()
    if length is not None and len(data) != int(length):
        raise ValueError(f"{tensor.name}: {path} ends before its {length} bytes")
    return data


class FileValues(LazyValues):
    """A constant whose values stay in their file until read (each read reads the file)."""

    def __init__(self, tensor: onnx.TensorProto, folder: Path):
        super().__init__(tensor)
        self.folder = Path(folder)

    def load(self) -> np.ndarray:
        return np.array(numpy_helper.to_array(self.tensor, base_dir=str(self.folder)))


class FileConstant(gs.Constant):
    """A Constant whose file-held values are read at each ask, never kept (gs.Constant
    keeps what it loaded: every weight a pass looked at would stay in memory)."""

    @property
    def values(self):
        if isinstance(self._values, FileValues):
            return self._values.load()
        return gs.Constant.values.fget(self)

    @values.setter
    def values(self, values) -> None:
        gs.Constant.values.fset(self, values)


def import_lazy(path: Path) -> gs.Graph:
    """The model at `path` as a graph whose external weights stay in their files."""
    graph = gs.import_onnx(onnx.load(str(path), load_external_data=False))
    for g in (graph, *graph.subgraphs(recursive=True)):
        for tensor in g.tensors().values():
            values = getattr(tensor, "_values", None)
            if (isinstance(tensor, gs.Constant) and type(values) is LazyValues
                    and values.tensor.data_location == EXTERNAL):
                tensor._values = FileValues(values.tensor, path.parent)
                tensor.__class__ = FileConstant
                # its proto says where it is; values a pass sets later are held inline
                tensor.data_location = None
    return graph


def inline_weights(model: onnx.ModelProto, graph: gs.Graph) -> onnx.ModelProto:
    """`model`, exported from `graph` (or a piece of it), with every weight that stayed in
    its file read into it: a session built from the model's bytes reads no files."""
    folders = {t.name: t._values.folder for t in graph.tensors().values()
               if isinstance(t, gs.Constant) and isinstance(t._values, FileValues)}
    for g in (model.graph, *(a.g for n in model.graph.node for a in n.attribute
                             if a.type == onnx.AttributeProto.GRAPH)):
        for tensor in g.initializer:
            if tensor.data_location == EXTERNAL and tensor.name in folders:
                data = read_raw(tensor, folders[tensor.name])
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
                tensor.raw_data = data
    return model


def session_bytes(graph: gs.Graph) -> bytes:
    """`graph` (a piece of the model the passes rewrite) as a model onnxruntime can build a
    session from, its weights inside."""
    return inline_weights(gs.export_onnx(graph, do_type_check=False), graph).SerializeToString()
