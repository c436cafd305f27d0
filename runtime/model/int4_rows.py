"""Low-bit projections as MatMulInt4 (kernels/cpu_int4.c): graph rewrite, group packing.

A draft that reads the main's KV cache runs 1-3 tokens a forward, right after the main's
step evicted its weights from the cache, so its forward is mostly a read of every projection:
MatMulInt4's groups of 16 interleaved rows read it faster than onnxruntime's MatMulNBits,
and many rows gain as much (docs/performance.md, MatMulInt4). `dsc compile` packs them
(pack_int4) into the bundle's `<role>/int4.bin` beside a graph that reads them
(`model_int4.onnx`, compiler/int4_stage.py), so a load only sets each node's path and
threads for its CPU (set_int4_paths); other executors (segments, CUDA, a CPU without the
op's vector paths) run the bundle's MatMulNBits graph and never see the op.

Rewritten: MatMulNBits with 4 or 8 bits, blocks of 32, accuracy level 4 (int8 arithmetic,
which MatMulInt4 does too), no group index or bias, K a multiple of 32, weights, scales and
zero points (if any: uint8 or float, the op's mins) stored as initializers. Anything else
stays as it is. A main's too: MatMulInt4 sums a block's products in another order than
MatMulNBits (results agree to rounding, which `dsc verify` bounds by the original's own
int8 noise), but each row of x alone and in the same order whatever the rows beside it, so
a verify window scores every position as decoding it would: speculation cannot change an
int4 main's output (MatMulNBits' own kernels differ between one row and several).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark.kernels.cpu_op import ISA_PATHS, int4_timings
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.file_read import read_parts

OP = "MatMulInt4"
DOMAIN = "ai.dspark"
BLOCK = 32
LANES = 16  # outputs per group
GROUPS_SUFFIX = "/int4_groups"  # a packed projection's initializer: its output's name + this


def unpack(b: np.ndarray, k: int, n: int, bits: int) -> np.ndarray:
    """MatMulNBits' B ([N, K/32, 16] uint8 at 4 bits: input 2i in a byte's low nibble, 2i+1 in
    its high; [N, K/32, 32] at 8) as the stored values [N, K] (uint8)."""
    if bits == 8:
        return np.asarray(b, np.uint8).reshape(n, k)
    pairs = np.asarray(b, np.uint8).reshape(n, k // 2)
    q = np.empty((n, k), np.uint8)
    q[:, 0::2], q[:, 1::2] = pairs & 15, pairs >> 4
    return q


def _halves(values: np.ndarray, groups: int, n: int, blocks: int) -> np.ndarray:
    """[N * K/32] values as float16 [groups, blocks, 16] (rows past N zeros), as bytes."""
    halves = np.zeros((groups * LANES, blocks), "<f2")
    halves[:n] = np.asarray(values, np.float32).reshape(n, blocks)
    halves = np.ascontiguousarray(halves.reshape(groups, LANES, blocks).transpose(0, 2, 1))
    return halves.view(np.uint8)


def pack_groups(b: np.ndarray, scales: np.ndarray, k: int, n: int, bits: int = 4,
                mins: np.ndarray | None = None) -> np.ndarray:
    """MatMulNBits' B (see unpack) and scales ([N * K/32] float32), and with `mins` the
    blocks' mins ([N * K/32]: weight = scale * stored + min), as MatMulInt4's groups
    [ceil(N/16), K/32, record] (cpu_int4.c). At 4 bits, per block 4 vectors whose lane i holds
    row i's inputs 8v .. 8v+7, input 8v + j in byte j's low nibble and 8v + 4 + j in its high
    one; at 8 bits 8 vectors whose lane i holds row i's inputs 4v .. 4v+3. Then the 16 rows'
    scales as float16, then their mins. Rows past N are zeros."""
    groups, blocks = -(-n // LANES), k // BLOCK
    q = np.zeros((groups * LANES, k), np.uint8)
    q[:n] = unpack(b, k, n, bits)
    if bits == 8:  # group, lane, block, vector, byte
        vectors = q.reshape(groups, LANES, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    else:  # group, lane, block, vector, half, byte
        q = q.reshape(groups, LANES, blocks, 4, 2, 4)
        vectors = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)
    parts = [vectors.reshape(groups, blocks, 64 * bits), _halves(scales, groups, n, blocks)]
    if mins is not None:
        parts.append(_halves(mins, groups, n, blocks))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def initializer_array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's values, read from its external file under `folder` when it has one
    (not through onnx's loader: it refuses a hard-linked weights file, as cached bundles
    are)."""
    return initializer_arrays([tensor], folder)[0]


def initializer_arrays(tensors: list[onnx.TensorProto], folder: Path) -> list[np.ndarray]:
    """initializer_array of each, the external ones read together (model/file_read.py)."""
    external = [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]
    parts, shapes = [], []
    for tensor in external:
        info = {entry.key: entry.value for entry in tensor.external_data}
        path = (Path(folder) / info["location"]).resolve()
        if Path(folder).resolve() not in path.parents:
            raise ValueError(f"{tensor.name}: external data {info['location']!r} is outside "
                             f"{folder}")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
        count = int(np.prod(tensor.dims, dtype=np.int64))
        parts.append((path, int(info.get("offset", 0)), count * dtype.itemsize))
        shapes.append((dtype, tuple(tensor.dims)))
    try:
        read = iter([a.view(d).reshape(s) for a, (d, s) in zip(read_parts(parts), shapes)])
    except EOFError as e:
        raise ValueError(f"external data: {e}") from None
    return [next(read) if t.data_location == onnx.TensorProto.EXTERNAL
            else numpy_helper.to_array(t) for t in tensors]


def _eligible(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> bool:
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input)
    while inputs and not inputs[-1]:
        inputs.pop()
    # float32 scales: a float16 model's (transformers.js's q4f16) keeps onnxruntime's kernel
    return (len(inputs) in (3, 4) and all(name in initializers for name in inputs[1:])
            and initializers[inputs[2]].data_type == onnx.TensorProto.FLOAT
            and attrs.get("bits", 4) in (4, 8) and attrs.get("block_size") == BLOCK
            and attrs.get("accuracy_level", 0) == 4 and attrs.get("K", 0) % BLOCK == 0
            and attrs.get("K", 0) > 0 and attrs.get("N", 0) > 0)


def _halves_hold(values: np.ndarray) -> bool:
    """float16 keeps every value to 2^-11 (normal range; zero stays zero)."""
    mags = np.abs(np.asarray(values, np.float32))
    return bool(np.all(mags < 65000) and np.all((mags == 0) | (mags >= 2.0 ** -14)))


def _mins_hold(mins: np.ndarray) -> bool:
    """float16 keeps every min to 2^-11 relative, or to 2^-25 absolute where it is tiny: far
    below any scale _halves_hold keeps."""
    return bool(np.all(np.abs(np.asarray(mins, np.float32)) < 65000))


def block_mins(zero_points: np.ndarray | None, scales: np.ndarray, bits: int, n: int,
               blocks: int) -> np.ndarray | None:
    """MatMulNBits' zero points as the blocks' mins (weight = scale * (stored - zp) = scale *
    stored + min, min = -zp * scale), None where they are the default (8 at 4 bits, 128 at 8).
    uint8 zero points are packed like B (two per byte at 4 bits, low nibble first, each row's
    padded to a byte); float ones are one per block."""
    if zero_points is None:
        return None
    zp = zero_points
    if zp.dtype == np.uint8:
        if bits == 4:
            packed = zp.reshape(n, -1)
            zp = np.empty((n, packed.shape[1] * 2), np.uint8)
            zp[:, 0::2], zp[:, 1::2] = packed & 15, packed >> 4
            zp = zp[:, :blocks]
        if np.all(zp == (8 if bits == 4 else 128)):
            return None
    zp = np.asarray(zp, np.float32).reshape(-1)
    return (-zp * np.asarray(scales, np.float32).reshape(-1)).astype(np.float32)


def int4_path(paths: tuple[str, ...], enabled: bool, forced: str | None) -> str | None:
    """The MatMulInt4 path to run among the CPU's `paths` (kernels/cpu_op.int4_paths, best
    last), or None to keep MatMulNBits: the best when it is a vector path, the plain loops
    only when forced (measured slower than onnxruntime's kernel: README, MatMulInt4)."""
    if not enabled or not paths:
        return None
    if forced is not None:
        if forced not in paths:
            raise DSparkError(f"DSPARK_CPU_ISA={forced}: this CPU runs MatMulInt4's "
                              f"{', '.join(paths)} paths")
        return forced
    return None if paths[-1] == "generic" else paths[-1]


def few_rows_path(best: str, paths: tuple[str, ...],
                  timings: Callable[[tuple[str, ...]], dict[str, float]]) -> str:
    """The path for an 8-bit projection's calls of one or two rows (MatMulInt4's `isa_few`).
    On a CPU with AVX-512 VNNI its BW path has streamed the 8-bit head faster, though it
    multiplies twice as often (docs/experiments.md, "Figures behind the source's choices");
    the cause is not known, so where the CPU has both, `timings` (seconds per path, on the
    projection's own weights) decides: the BW path if it is faster by 5% or more, else
    `best`."""
    if best != "avx512_vnni" or "avx512" not in paths:
        return best
    seconds = timings(("avx512_vnni", "avx512"))
    return "avx512" if seconds["avx512"] < 0.95 * seconds["avx512_vnni"] else best


def few_rows_chooser(library: Path, best: str, paths: tuple[str, ...]
                     ) -> Callable[[np.ndarray, int, int, int, bool], int]:
    """rewrite_int4's `few_rows` for this CPU: few_rows_path, timed with the library."""
    def choose(packed: np.ndarray, k: int, n: int, bits: int, mins: bool) -> int:
        return ISA_PATHS.index(few_rows_path(best, paths, lambda isas: int4_timings(
            library, isas, packed, k, n, bits, mins)))

    return choose


def pack_int4(model: onnx.ModelProto, folder: Path,
              place: Callable[[onnx.TensorProto], None] | None = None) -> int:
    """Every eligible MatMulNBits of `model` (its external data under `folder`) becomes a
    MatMulInt4 reading packed groups, held in the model; the count rewritten. `place(t)`:
    called on each group's initializer as it is made, to move its data out of the model
    (the compiler writes it to the bundle's int4.bin: one projection in memory at a time).
    A projection whose scales or mins float16 cannot hold stays MatMulNBits. Which paths
    and threads each runs is this machine's (set_int4_paths)."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    done, replaced = 0, set()
    for node in graph.node:
        if not _eligible(node, initializers):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits = int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4))
        b = initializer_array(initializers[node.input[1]], folder)
        scales = initializer_array(initializers[node.input[2]], folder)
        zero_points = (initializer_array(initializers[node.input[3]], folder)
                       if len(node.input) > 3 and node.input[3] else None)
        mins = block_mins(zero_points, scales, bits, n, k // BLOCK)
        if not _halves_hold(scales) or (mins is not None and not _mins_hold(mins)):
            continue
        rows_name = node.output[0] + GROUPS_SUFFIX  # output names are unique in a graph
        packed = pack_groups(b, scales, k, n, bits, mins)
        graph.initializer.append(numpy_helper.from_array(packed, rows_name))
        del packed
        if place is not None:
            place(graph.initializer[-1])
        replaced.update(name for name in node.input[1:] if name)
        new = helper.make_node(OP, [node.input[0], rows_name], list(node.output), name=node.name,
                               domain=DOMAIN, K=k, N=n, bits=bits, mins=int(mins is not None))
        node.CopyFrom(new)
        done += 1
    if done:
        used = {name for node in graph.node for name in node.input}
        keep = [t for t in graph.initializer if t.name not in replaced or t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return done


def set_int4_paths(model: onnx.ModelProto, folder: Path, threads: int, isa: int = -1,
                   few_rows: Callable[..., int] | None = None) -> int:
    """Each MatMulInt4 of `model` split over `threads`, on path `isa` (kernels/cpu_int4.h;
    -1: the best the CPU runs); the count. `few_rows(packed, k, n, bits, mins)`: an 8-bit
    projection's path for calls of one or two rows (default `isa`; its packed groups are
    read from `folder` only then)."""
    initializers = {t.name: t for t in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        if node.op_type != OP or node.domain != DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        few = isa
        if few_rows is not None and attrs["bits"] == 8:
            packed = initializer_array(initializers[node.input[1]], folder)
            few = few_rows(packed, attrs["K"], attrs["N"], 8, bool(attrs["mins"]))
        keep = [a for a in node.attribute if a.name not in ("threads", "isa", "isa_few")]
        del node.attribute[:]
        node.attribute.extend([*keep, helper.make_attribute("threads", threads),
                               helper.make_attribute("isa", isa),
                               helper.make_attribute("isa_few", few)])
        count += 1
    return count


def rewrite_int4(model: onnx.ModelProto, folder: Path, threads: int, isa: int = -1,
                 few_rows: Callable[..., int] | None = None) -> int:
    """pack_int4, then set_int4_paths: the model as this machine runs it, its groups held
    in the model (dsc verify's original with the runtime's arithmetic)."""
    done = pack_int4(model, folder)
    set_int4_paths(model, folder, threads, isa, few_rows)
    return done
