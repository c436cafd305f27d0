"""What a verify of k tokens costs onnxruntime's GEMM against a decode step, one MatMul alone.

    python bench/bench_gemm_rows.py [--rows 1,2,3,5,8] [--n 49152] [--k 576]

One fp32 MatMul [rows, k] x [k, n] (default: SmolLM2's LM head, 113 MB of weights) on the
process-wide pool dsrun uses, median of 30 runs per row count, printed with its ratio to one
row. A model's verify/decode ratio cannot go below this GEMM's: every layer is such MatMuls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from dspark.runtime.model.sessions import make_session


def session(k: int, n: int):
    weights = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return make_session(model.SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,5,8")
    ap.add_argument("--n", type=int, default=49152)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    sess = session(args.k, args.n)
    base = None
    for rows in (int(r) for r in args.rows.split(",")):
        x = np.random.default_rng(rows).standard_normal((rows, args.k)).astype(np.float32)
        for _ in range(5):
            sess.run(None, {"x": x})
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sess.run(None, {"x": x})
            times.append(time.perf_counter() - t0)
        ms = 1000 * statistics.median(times)
        base = base or ms
        print(f"rows {rows:3d}: {ms:7.3f} ms  {ms / base:.3f}x of one row")


if __name__ == "__main__":
    main()
