"""The CPU's low-bit graph: each role's projections packed for MatMulInt4 at compile time.

runtime/model/int4_rows.py's packing (pack_int4) reads every eligible MatMulNBits' weights,
scales and zero points and interleaves them in groups of 16 rows. Done at each load, a
1.1B int4 main spent 5 s packing and 3.3 s serializing the packed model into onnxruntime.
Here it runs once: `<role>/model_int4.onnx` is the role's whole graph with those nodes as
MatMulInt4, their groups in `<role>/int4.bin` (page-aligned, so onnxruntime may map them),
every other weight still read from `<role>/weights.bin`. The load sets only what depends
on the machine (each node's path and threads) on a graph of a few MB. The MatMulNBits graph
stays beside it for the executors that do not run the op.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from dspark.compiler.weights import open_store
from dspark.runtime.model.int4_rows import pack_int4

INT4_GRAPH, INT4_DATA = "model_int4.onnx", "int4.bin"


def write_int4_graph(out: Path, graph_file: str) -> str | None:
    """`graph_file` (relative to the bundle root `out`) with its low-bit projections as
    MatMulInt4: the new graph's path relative to `out`, or None when none is eligible
    (nothing written)."""
    path = out / graph_file
    model = onnx.load(str(path), load_external_data=False)
    data = path.parent / INT4_DATA
    f, store = open_store(data)
    with f:
        packed = pack_int4(model, path.parent, store.externalize_one)
    if not packed:
        data.unlink()
        return None
    target = path.parent / INT4_GRAPH
    onnx.save(model, str(target))
    return target.relative_to(out).as_posix()
