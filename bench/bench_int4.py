"""MatMulInt4 on each path this CPU runs against onnxruntime's MatMulNBits, one projection alone.

    python bench/bench_int4.py [--rows 1,4,9] [--repeats 40] [--shapes smollm2|gemma3]
                                 [--against REV]

Per projection shape of the model (SmolLM2: qkv 576x960, o 576x576, gate/up 576x3072, down
1536x576, the 8-bit head 576x49152), blocks of 32 at accuracy level 4 (int8 inputs):
onnxruntime's MatMulNBits with each zero-point form (symmetric, uint8, float: dsc quantize's;
"float zp split": the symmetric kernel plus the zero points' share, what the runtime runs
without MatMulInt4, runtime/model/zero_points.py) and MatMulInt4 on every path the CPU has
(kernels/cpu_int4*.c; generic: the plain loops), all on the process-wide pool dsrun uses
with its thread count, interleaved (each round runs every variant once, in a rotated order),
median microseconds and the ratio to onnxruntime's symmetric kernel. The weights are large
enough to come from memory, as in a decode step.
With --against, every path of REV's MatMulInt4 (its kernels built from a worktree, as
bench_revisions.py checks revisions out) runs in the same rounds, "@REV" after its name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from revision import revision

from dspark.kernels.cpu_op import ISA_PATHS, int4_paths, op_library
from dspark.runtime.env import kernel_cache_dir, read_env
from dspark.runtime.model.device import cpu_line
from dspark.runtime.model.int4_rows import block_mins, pack_groups
from dspark.runtime.model.sessions import init_threads, make_session
from dspark.runtime.model.zero_points import split_float_zero_points

SHAPES = {"smollm2": [("qkv", 576, 960, 4), ("o", 576, 576, 4), ("gate_up", 576, 3072, 4),
                      ("down", 1536, 576, 4), ("head", 576, 49152, 8)],
          "gemma3": [("qkv", 640, 1536, 4), ("o", 1024, 640, 4), ("gate_up", 640, 4096, 4),
                     ("down", 2048, 640, 4), ("head", 640, 262144, 8)]}


def _model(node, k: int, inits) -> bytes:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
        helper.make_opsetid("ai.dspark", 1)]).SerializeToString()


def revision_library(rev: str) -> Path:
    """REV's kernel library, built by REV's own code into the kernel cache."""
    from bench_revisions import checkout

    code = ("from dspark.kernels.cpu_op import op_library\n"
            "from dspark.runtime.env import kernel_cache_dir, read_env\n"
            "built = op_library(kernel_cache_dir(), read_env().cc)\n"
            "print(built.path or '', built.reason, sep='\\n')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(checkout(rev))})
    path = done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else ""
    if not path:
        sys.exit(f"--against {rev}: its kernels did not build: {done.stderr.strip()[-300:]}")
    return Path(path)


def variants(k: int, n: int, bits: int, library, threads: int,
             others: dict[str, Path]) -> dict:
    rng = np.random.default_rng(k * n)
    b = rng.integers(0, 256, (n, k // 32, 4 * bits), dtype=np.uint8)
    scales = (rng.random(n * k // 32, dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    zero = {"symmetric": None,
            "uint8 zp": (rng.integers(0, 256, n * k // 32 // (2 if bits == 4 else 1),
                                      dtype=np.uint8)),
            "float zp": rng.random(n * k // 32, dtype=np.float32) * (2 ** bits - 1)}
    out = {}
    for name, zp in zero.items():
        if name == "float zp" and bits == 8:
            continue  # onnxruntime has no 8-bit float zero points on the CPU
        inputs = ["x", "B", "S"] + (["Z"] if zp is not None else [])
        inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
        inits += [numpy_helper.from_array(zp, "Z")] if zp is not None else []
        node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k,
                                N=n, bits=bits, block_size=32, accuracy_level=4)
        out[f"MatMulNBits {name}"] = make_session(_model(node, k, inits))
        if name == "float zp":  # what the runtime runs without MatMulInt4 (zero_points.py)
            model = onnx.load_from_string(_model(node, k, inits))
            split_float_zero_points(model, Path("."))
            out["MatMulNBits float zp split"] = make_session(model.SerializeToString())
    mins = block_mins(zero["float zp"] if bits == 4 else None, scales, bits, n, k // 32)
    packed = numpy_helper.from_array(pack_groups(b, scales, k, n, bits, mins), "w")
    for suffix, lib in {"": library, **{f" @{rev}": p for rev, p in others.items()}}.items():
        for isa in int4_paths(lib):
            node = helper.make_node("MatMulInt4", ["x", "w"], ["y"], domain="ai.dspark", K=k,
                                    N=n, threads=threads, bits=bits, mins=int(mins is not None),
                                    isa=ISA_PATHS.index(isa))
            out[f"MatMulInt4 {isa}{suffix}"] = make_session(_model(node, k, [packed]),
                                                            custom_ops=lib)
    return out


def measure(sessions: dict, x: np.ndarray, repeats: int) -> dict[str, float]:
    names = list(sessions)
    for s in sessions.values():
        s.run(None, {"x": x})
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            sessions[name].run(None, {"x": x})
            times[name].append(time.perf_counter() - t0)
    return {n: 1e6 * statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,9")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    ap.add_argument("--against", metavar="REV", action="append", default=[],
                    help="also time this revision's MatMulInt4 (repeatable)")
    args = ap.parse_args()
    init_threads()
    env = read_env()
    library = op_library(kernel_cache_dir(), env.cc).path
    others = {rev: revision_library(rev) for rev in args.against}
    print(cpu_line())
    print(f"MatMulInt4 paths: {', '.join(int4_paths(library))}; {env.threads} threads; "
          f"median us of {args.repeats} interleaved runs; ratio to MatMulNBits symmetric")
    rows_out = []
    for name, k, n, bits in SHAPES[args.shapes]:
        sessions = variants(k, n, bits, library, env.threads, others)
        for rows in (int(r) for r in args.rows.split(",")):
            x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
            us = measure(sessions, x, args.repeats)
            base = us["MatMulNBits symmetric"]
            print(f"{name} {k}x{n} {bits}-bit, {rows} rows: " + ", ".join(
                f"{v} {t:.0f} ({t / base:.2f}x)" for v, t in us.items()))
            rows_out.append({"projection": name, "k": k, "n": n, "bits": bits, "rows": rows,
                             "us": us})
    if args.json:
        report = {"cpu": cpu_line(), "revision": revision(), "threads": env.threads,
                  "repeats": args.repeats, "against": args.against, "rows": rows_out}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
