"""MatMulInt4 (kernels/cpu_int4.c); the rewrite that uses it: test_int4_rows.py.

The op in a one-node graph on every path this CPU runs (the plain loops always: the forced
generic path) against numpy's arithmetic of the same blocks (int8 inputs, exact block dot
products, float16 scales), and every path against every other bit for bit.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark.kernels.cpu_op import ISA_PATHS, int4_paths, op_library
from dspark.runtime.env import kernel_cache_dir, read_env
from dspark.runtime.model.int4_rows import pack_groups
from dspark.runtime.model.sessions import make_session

INVALID = ort.capi.onnxruntime_pybind11_state.InvalidArgument


@pytest.fixture(scope="module")
def library():
    built = op_library(kernel_cache_dir(), read_env().cc)
    assert built.path is not None, built.reason
    return built.path


def _weights(rng, k: int, n: int, bits: int = 4):
    b = rng.integers(0, 256, (n, k // 32, 4 * bits), dtype=np.uint8)
    scales = (rng.random(n * k // 32, dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    return b, scales


def _mins(rng, k: int, n: int):
    return (-rng.random(n * k // 32, dtype=np.float32) * 0.1).astype(np.float32)


def _nbits_model(k: int, n: int, b, scales, rows: int, *, level: int = 4, block: int = 32,
                 bits: int = 4, extra_inputs: tuple[str, ...] = (), extra_inits=()):
    node = helper.make_node("MatMulNBits", ["x", "B", "S", *extra_inputs], ["y"], name="mm",
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                            accuracy_level=level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"), *extra_inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _op_session(library, k: int, n: int, rows_w: np.ndarray, **attrs):
    node = helper.make_node("MatMulInt4", ["x", "w"], ["y"], domain="ai.dspark", K=k, N=n,
                            **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rows_w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ai.dspark", 1)])
    return make_session(model.SerializeToString(), custom_ops=library)


def _numpy_blocks(x: np.ndarray, b: np.ndarray, scales: np.ndarray, k: int, n: int,
                  bits: int = 4, mins: np.ndarray | None = None):
    """The op's arithmetic in float64: x to int8 per block of 32 (max|x|/127, to nearest),
    weights (stored - zero) * float16(scale), zero 8 at 4 bits and 128 at 8, or with mins
    stored * float16(scale) + float16(min); a block's dot product exact."""
    if bits == 8:
        q = b.reshape(n, k).astype(np.int64)
    else:
        pairs = b.reshape(n, k // 2)
        q = np.empty((n, k), np.int64)
        q[:, 0::2], q[:, 1::2] = pairs & 15, pairs >> 4
    zero = 0 if mins is not None else 8 if bits == 4 else 128
    blocks = x.reshape(len(x), k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    x8 = np.rint(blocks * inv).astype(np.int64)
    sx = (amax / np.float32(127)).astype(np.float32)[..., 0]
    d = scales.astype(np.float16).astype(np.float64).reshape(n, k // 32)
    dots = np.einsum("rbi,nbi->rnb", x8, (q - zero).reshape(n, k // 32, 32))
    out = np.einsum("rnb,nb,rb->rn", dots.astype(np.float64), d, sx.astype(np.float64))
    if mins is not None:
        m = mins.astype(np.float16).astype(np.float64).reshape(n, k // 32)
        out += np.einsum("rb,nb,rb->rn", x8.sum(axis=2).astype(np.float64), m,
                         sx.astype(np.float64))
    return out


FORMATS = [(4, False), (4, True), (8, False), (8, True)]  # bits, mins
SHAPES = [(32, 3, 1, 1), (64, 5, 1, 1), (128, 64, 2, 2), (192, 33, 3, 2), (576, 130, 1, 2),
          (576, 70, 5, 3), (96, 17, 4, 2), (1536, 48, 9, 2),
          # rows sharing one load of the weights: up to 4 on AVX2, 12 on AVX-512, then again
          (32, 16, 7, 1), (64, 20, 8, 1), (160, 17, 11, 2), (128, 40, 12, 2), (96, 33, 13, 1),
          (64, 18, 27, 2)]  # k, n, rows, threads


def _paths() -> tuple[str, ...]:
    built = op_library(kernel_cache_dir(), read_env().cc)
    return int4_paths(built.path) if built.path is not None else ()


def _run_path(library, isa: str, x, packed, rows, k, n, bits, mins) -> np.ndarray:
    """One path alone, through the library's C entry point."""
    y = np.full((rows, n), np.nan, np.float32)
    run = ctypes.CDLL(str(library)).dspark_int4_run
    run.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    assert run(ISA_PATHS.index(isa), x.ctypes.data, packed.ctypes.data, y.ctypes.data, rows,
               k, n, bits, int(mins)) == 1
    return y


def test_this_cpu_runs_the_paths_its_flags_name(library):
    """Reported from what the CPU says, the way the runtime picks; the plain loops always."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    want = ["generic"]
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
    want += ["avx2"] * avx2 + ["avx_vnni"] * (avx2 and "avx_vnni" in flags)
    want += ["avx512"] * avx512 + ["avx512_vnni"] * (avx512 and "avx512_vnni" in flags)
    want += ["neon_dotprod"] * ("asimddp" in flags)  # aarch64's /proc/cpuinfo Features
    assert list(int4_paths(library)) == want


@pytest.mark.parametrize("bits,with_mins", FORMATS)
@pytest.mark.parametrize("k,n,rows,threads", SHAPES)
@pytest.mark.parametrize("isa", _paths())
def test_op_computes_the_blocks(library, k, n, rows, threads, bits, with_mins, isa):
    """Each path in the op (its `isa` attribute), against numpy and the plain loops."""
    rng = np.random.default_rng(k + n + rows + bits)
    b, scales = _weights(rng, k, n, bits)
    mins = _mins(rng, k, n) if with_mins else None
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros, not NaN
    packed = pack_groups(b, scales, k, n, bits, mins)
    got = _op_session(library, k, n, packed, threads=threads, bits=bits, mins=int(with_mins),
                      isa=ISA_PATHS.index(isa)).run(None, {"x": x})[0]
    want = _numpy_blocks(x, b, scales, k, n, bits, mins)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    plain = _run_path(library, "generic", x, packed, rows, k, n, bits, with_mins)
    np.testing.assert_array_equal(got, plain)  # every path: the same bits


@pytest.mark.parametrize("rows", [3, 7])
@pytest.mark.parametrize("bits,with_mins", FORMATS)
def test_every_path_gives_the_same_bits(library, bits, with_mins, rows):
    """Extreme inputs (every input at +-127, one value setting its block's scale) over all
    16 rows of a group, weights at their extremes: the int16 sums without VNNI must not
    saturate, in either order of summing (without VNNI, up to 6 rows of x go inside the
    weights' loop, more take the block's weights unpacked whole)."""
    rng = np.random.default_rng(bits * 2 + with_mins)
    k, n = 256, 45
    b = rng.choice(np.array([0, 15 * 17, 255], np.uint8), (n, k // 32, 4 * bits))
    scales = (rng.random(n * k // 32, dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    mins = _mins(rng, k, n) if with_mins else None
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x[1] = np.where(np.arange(k) % 2, 1e3, -1e3)
    x[2, 5] = 1e6
    packed = pack_groups(b, scales, k, n, bits, mins)
    results = {isa: _run_path(library, isa, x, packed, rows, k, n, bits, with_mins)
               for isa in int4_paths(library)}
    want = _numpy_blocks(x, b, scales, k, n, bits, mins)
    for isa, y in results.items():
        np.testing.assert_array_equal(y, results["generic"], err_msg=isa)
    np.testing.assert_allclose(results["generic"], want, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())


def test_a_path_the_cpu_lacks_is_refused(library):
    missing = [i for i, name in enumerate(ISA_PATHS) if name not in int4_paths(library)]
    b, scales = _weights(np.random.default_rng(1), 64, 16)
    for isa in [*missing, len(ISA_PATHS)]:
        with pytest.raises(Exception, match="isa or isa_few names a path this CPU does not"):
            _op_session(library, 64, 16, pack_groups(b, scales, 64, 16), isa=isa)


def test_a_few_rows_path_serves_one_and_two_rows_with_the_same_bits(library):
    """`isa_few` runs calls of one or two rows, `isa` the rest: the same bits either way."""
    paths = int4_paths(library)
    rng = np.random.default_rng(11)
    k, n = 96, 40
    b, scales = _weights(rng, k, n, 8)
    packed = pack_groups(b, scales, k, n, 8)
    for rows in (1, 2, 3, 5):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        want = _run_path(library, "generic", x, packed, rows, k, n, 8, False)
        for isa, few in [(paths[-1], "generic"), ("generic", paths[-1])]:
            got = _op_session(library, k, n, packed, bits=8, isa=ISA_PATHS.index(isa),
                              isa_few=ISA_PATHS.index(few)).run(None, {"x": x})[0]
            np.testing.assert_array_equal(got, want, err_msg=f"{isa}/{few}, {rows} rows")
    missing = [i for i, name in enumerate(ISA_PATHS) if name not in paths]
    for few in [*missing, len(ISA_PATHS)]:
        with pytest.raises(Exception, match="isa or isa_few names a path this CPU does not"):
            _op_session(library, k, n, packed, bits=8, isa=0, isa_few=few)


def test_the_runtime_picks_the_best_vector_path_or_the_forced_one():
    from dspark.runtime.errors import DSparkError
    from dspark.runtime.model.int4_rows import int4_path

    every = ("generic", "avx2", "avx512")
    assert int4_path(every, True, None) == "avx512"
    assert int4_path(("generic",), True, None) is None  # slower than onnxruntime's kernel
    assert int4_path(every, True, "generic") == "generic"  # forced: the plain loops
    assert int4_path(every, False, "avx2") is None  # DSPARK_CPU_INT4=0
    with pytest.raises(DSparkError, match="DSPARK_CPU_ISA=avx512_vnni: this CPU runs"):
        int4_path(every, True, "avx512_vnni")


def test_op_keeps_the_input_shape(library):
    rng = np.random.default_rng(3)
    b, scales = _weights(rng, 128, 16)
    x = rng.standard_normal((1, 3, 128), dtype=np.float32)
    got = _op_session(library, 128, 16, pack_groups(b, scales, 128, 16), threads=2).run(
        None, {"x": x})[0]
    assert got.shape == (1, 3, 16)
    np.testing.assert_allclose(got[0], _numpy_blocks(x[0], b, scales, 128, 16), rtol=2e-5,
                               atol=1e-5)


def test_bad_weights_are_refused(library):
    rng = np.random.default_rng(2)
    b, scales = _weights(rng, 128, 8)
    packed = pack_groups(b, scales, 128, 8)
    wide = np.zeros((2, *packed.shape[1:]), np.uint8)  # not ceil(N/16) groups
    with pytest.raises(INVALID, match="MatMulInt4: x must be"):
        _op_session(library, 128, 8, wide).run(None, {"x": np.ones((1, 128), np.float32)})
    with pytest.raises(INVALID, match="MatMulInt4: x must be"):
        _op_session(library, 128, 8, packed).run(None, {"x": np.ones((1, 64), np.float32)})


def test_no_rows_give_no_rows(library):
    """A mixture of experts' expert that no token of a forward picked: x [0, K], made inside
    the graph (onnxruntime gives such a tensor no buffer)."""
    rng = np.random.default_rng(5)
    b, scales = _weights(rng, 64, 16, 4)
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    nodes = [helper.make_node("Slice", ["rows", "zero", "zero", "zero"], ["x"]),
             helper.make_node("MatMulInt4", ["x", "w"], ["y"], domain="ai.dspark", K=64, N=16)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(pack_groups(b, scales, 64, 16), "w"), zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ai.dspark", 1)])
    session = make_session(model.SerializeToString(), custom_ops=library)
    assert session.run(None, {"rows": np.ones((3, 64), np.float32)})[0].shape == (0, 16)
