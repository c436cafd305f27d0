"""Float zero points (a min per block) in the form onnxruntime runs fast.

`dsc quantize` keeps a GGUF's Q4_1 blocks exactly: weight = scale * code + min, which
MatMulNBits holds as a float zero point per block (zp = -min / scale). onnxruntime has no
fast kernel for float zero points: it runs them in float32, 7-31x a symmetric MatMulNBits
per projection (docs/benchmarks.md). MatMulInt4 takes the mins itself (int4_rows.py), but
where it does not run (a CPU without its vector paths, DSPARK_CPU_INT4=0, no C compiler, or
scales float16 cannot hold) each such MatMulNBits becomes one with uint8 zero points, each
block's float one rounded (z_nb, within the codes' range), plus what the rounding moved:

    y_n = sum_b scale_nb sum_i (code_i - zp_nb) x_i
        = MatMulNBits_uint8(x)_n + sum_b c_nb X_b,   c_nb = scale_nb (z_nb - zp_nb)

X_b, the sum of x over block b, is a MatMul with a 0/1 [K, K / block] matrix (one per input
and block size, shared by the projections that read it), and the weighted sum a MatMul with
c as [K / block, N]. The same function, summed in another order: at accuracy level 0
SmolLM2's draft gives the original's logits to 1.7e-4 (of ~32) on 40 tokens. The uint8
kernel keeps the node's accuracy level (4: its inputs rounded to int8 per block, as
MatMulInt4 does): the draft's logits then move by 1.71 from the original's on 40 tokens,
MatMulInt4's by 1.65. Rounded zero points keep each shift within half a scale where the
block spans zero (the default 8 for all of them took as long and moved the logits as far,
with larger shifts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark.runtime.model.int4_rows import initializer_array

FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _float_zero_points(node: onnx.NodeProto, initializers: dict) -> bool:
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    inputs = list(node.input)
    while inputs and not inputs[-1]:
        inputs.pop()
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    block, k = int(attrs.get("block_size", 0)), int(attrs.get("K", 0))
    return (len(inputs) == 4 and all(name in initializers for name in inputs[1:])
            and initializers[inputs[3]].data_type in FLOATS
            and block > 0 and k > 0 and k % block == 0 and int(attrs.get("N", 0)) > 0)


def _packed(zero_points: np.ndarray, bits: int) -> np.ndarray:
    """uint8 zero points [N, blocks] as MatMulNBits reads them: at 4 bits two a byte, low
    nibble first, each row padded to a byte."""
    z = zero_points.astype(np.uint8)
    if bits != 4:
        return z.reshape(-1)
    if z.shape[1] % 2:
        z = np.pad(z, ((0, 0), (0, 1)))
    return (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)


def split_float_zero_points(model: onnx.ModelProto, folder: Path) -> int:
    """Every MatMulNBits of `model` with float zero points (its weights' external data under
    `folder`) becomes one with uint8 zero points plus what their rounding moved (module
    doc); the count rewritten."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes, sums, done, dropped = [], {}, 0, set()
    for node in graph.node:
        if not _float_zero_points(node, initializers):
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits = int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4))
        block = int(attrs["block_size"])
        blocks = k // block
        x, out = node.input[0], node.output[0]
        scales = initializer_array(initializers[node.input[2]], folder).astype(np.float32)
        zp = initializer_array(initializers[node.input[3]], folder).astype(np.float32)
        zp = zp.reshape(n, blocks)
        rounded = np.clip(np.rint(zp), 0, 2 ** bits - 1)
        shift = scales.reshape(n, blocks) * (rounded - zp)
        if (x, block) not in sums:
            ones = np.zeros((k, blocks), np.float32)
            ones[np.arange(k), np.arange(k) // block] = 1.0
            name = f"{out}/block_ones"
            graph.initializer.append(numpy_helper.from_array(ones, name))
            sums[x, block] = f"{out}/block_sums"
            nodes.append(helper.make_node("MatMul", [x, name], [sums[x, block]],
                                          name=f"{node.name}/block_sums"))
        shift_name = f"{out}/zero_point_shift"
        graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(shift.T), shift_name))
        zp_name = f"{out}/zero_points"
        graph.initializer.append(numpy_helper.from_array(_packed(rounded, bits), zp_name))
        rounded_node = helper.make_node("MatMulNBits", [*node.input[:3], zp_name],
                                        [f"{out}/rounded"], name=node.name, domain=node.domain)
        rounded_node.attribute.extend(node.attribute)
        nodes += [rounded_node,
                  helper.make_node("MatMul", [sums[x, block], shift_name], [f"{out}/shift"],
                                   name=f"{node.name}/shift"),
                  helper.make_node("Add", [f"{out}/rounded", f"{out}/shift"], [out],
                                   name=f"{node.name}/add_shift")]
        dropped.add(node.input[3])
        done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        used = {name for node in graph.node for name in node.input}
        keep = [t for t in graph.initializer if t.name not in dropped or t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return done


def fast_zero_points(path: Path) -> bytes | None:
    """The ONNX file at `path` with its float zero points split (serialized; its external
    data stays beside `path`), None when it has none."""
    model = onnx.load(str(path), load_external_data=False)
    return model.SerializeToString() if split_float_zero_points(model, path.parent) else None
