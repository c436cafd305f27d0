"""The rewrite that runs MatMulNBits as MatMulInt4 (runtime/model/int4_rows.py): the packed
layout, agreement with onnxruntime's kernel to the scales' rounding, what it leaves as it
was, and the path it picks for an 8-bit projection's one- and two-row calls. The op itself:
test_cpu_int4.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper
from test_cpu_int4 import _nbits_model, _weights

from dspark.kernels.cpu_op import ISA_PATHS, op_library
from dspark.runtime.env import kernel_cache_dir, read_env
from dspark.runtime.model.int4_rows import pack_groups, rewrite_int4
from dspark.runtime.model.sessions import make_session


@pytest.fixture(scope="module")
def library():
    built = op_library(kernel_cache_dir(), read_env().cc)
    assert built.path is not None, built.reason
    return built.path


def test_the_few_rows_path_is_the_one_measured_faster():
    from dspark.runtime.model.int4_rows import few_rows_path

    both = ("generic", "avx2", "avx512", "avx512_vnni")
    asked = []

    def timings(vnni: float, bw: float):
        def measure(isas):
            asked.append(isas)
            return {"avx512_vnni": vnni, "avx512": bw}
        return measure

    assert few_rows_path("avx512_vnni", both, timings(1.0, 0.8)) == "avx512"
    assert few_rows_path("avx512_vnni", both, timings(1.0, 0.97)) == "avx512_vnni"  # < 5%
    assert few_rows_path("avx512_vnni", both, timings(0.8, 1.0)) == "avx512_vnni"
    assert len(asked) == 3
    # nothing to choose between: no timing at all
    assert few_rows_path("avx512", both[:3], timings(1.0, 0.5)) == "avx512"
    assert few_rows_path("avx512_vnni", ("generic", "avx512_vnni"), timings(1, 0.5)) == \
        "avx512_vnni"
    assert len(asked) == 3


def test_rewrite_asks_for_a_few_rows_path_for_8_bit_projections_only():
    rng = np.random.default_rng(5)
    asked = []

    def few_rows(packed, k, n, bits, mins):
        asked.append((packed.shape, k, n, bits, mins))
        return ISA_PATHS.index("generic")

    for bits in (4, 8):
        b, scales = _weights(rng, 64, 20, bits)
        model = _nbits_model(64, 20, b, scales, 1, bits=bits)
        assert rewrite_int4(model, ".", threads=1, isa=1, few_rows=few_rows) == 1
        attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
        assert (attrs["isa"], attrs["isa_few"]) == (1, 0 if bits == 8 else 1)
    assert [a[1:] for a in asked] == [(64, 20, 8, False)]


def _zero_points(rng, kind: str, bits: int, k: int, n: int):
    """MatMulNBits zero points: uint8 packed like B (two per byte at 4 bits) or float."""
    blocks = k // 32
    if kind == "float":
        return rng.random(n * blocks, dtype=np.float32) * (15 if bits == 4 else 255)
    zp = rng.integers(0, 16 if bits == 4 else 256, (n, blocks + blocks % 2 * (bits == 4)),
                      dtype=np.uint8)
    return (zp[:, 0::2] | (zp[:, 1::2] << 4)).reshape(-1) if bits == 4 else zp.reshape(-1)


@pytest.mark.parametrize("bits,zero", [(4, None), (4, "uint8"), (4, "float"), (8, None),
                                       (8, "uint8")])  # onnxruntime has no 8-bit float ones
def test_rewrite_agrees_with_matmulnbits(library, bits, zero):
    """What a draft's projection gives before and after: the same to float16 scales (and
    mins), and to int8 inputs where onnxruntime computes float zero points in float32."""
    rng = np.random.default_rng(7 + bits)
    for k, n, rows in [(576, 960, 1), (1536, 576, 3), (64, 130, 9), (96, 40, 2)]:
        b, scales = _weights(rng, k, n, bits)
        extra = {}
        if zero is not None:
            zp = _zero_points(rng, zero, bits, k, n)
            extra = {"extra_inputs": ("Z",), "extra_inits": (numpy_helper.from_array(zp, "Z"),)}
        x = rng.standard_normal((rows, k), dtype=np.float32)
        model = _nbits_model(k, n, b, scales, rows, bits=bits, **extra)
        before = make_session(model.SerializeToString()).run(None, {"x": x})[0]
        assert rewrite_int4(model, ".", threads=2) == 1
        assert [nd.op_type for nd in model.graph.node] == ["MatMulInt4"]
        assert {t.name for t in model.graph.initializer} == {"y/int4_groups"}
        attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
        assert (attrs["bits"], attrs["mins"]) == (bits, int(zero is not None))
        after = make_session(model.SerializeToString(), custom_ops=library).run(
            None, {"x": x})[0]
        scale = np.abs(before).max()
        assert np.abs(after - before).max() <= (2e-2 if zero == "float" else 2e-3) * scale
        assert np.abs(after - before).max() > 0  # float16 scales do round


def test_default_zero_points_need_no_mins():
    """uint8 zero points that are all the default (8 at 4 bits, 128 at 8) are no mins."""
    rng = np.random.default_rng(9)
    for bits, default in [(4, 0x88), (8, 128)]:
        b, scales = _weights(rng, 128, 8, bits)
        zp = numpy_helper.from_array(np.full(8 * 4 // (2 if bits == 4 else 1), default,
                                             np.uint8), "Z")
        model = _nbits_model(128, 8, b, scales, 1, bits=bits, extra_inputs=("Z",),
                             extra_inits=(zp,))
        assert rewrite_int4(model, ".", threads=1) == 1
        attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
        assert attrs["mins"] == 0


def test_pack_groups_layout():
    """Groups of 16 rows; per block 4 vectors whose lane i is row i's inputs 8v .. 8v+7 (8v + j
    low, 8v + 4 + j high in byte j), then the rows' float16 scales; rows past N are zeros."""
    k, n = 64, 20
    values = (np.arange(k)[None, :] * 7 + np.arange(n)[:, None] * 3) % 16
    b = (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // 32, 16)
    scales = np.arange(1, n * k // 32 + 1, dtype=np.float32)
    packed = pack_groups(b, scales, k, n)
    assert packed.shape == (2, k // 32, 288)
    for row in range(32):
        g, i = divmod(row, 16)
        for blk in range(k // 32):
            for v in range(4):
                for j in range(4):
                    byte = int(packed[g, blk, 64 * v + 4 * i + j])
                    first = values[row, 32 * blk + 8 * v + j] if row < n else 0
                    second = values[row, 32 * blk + 8 * v + 4 + j] if row < n else 0
                    assert (byte & 15, byte >> 4) == (first, second)
            half = packed[g, blk, 256 + 2 * i: 258 + 2 * i].copy().view("<f2")[0]
            assert half == (scales[row * (k // 32) + blk] if row < n else 0)


def test_pack_groups_layout_8_bits_with_mins():
    """At 8 bits, per block 8 vectors whose lane i is row i's inputs 4v .. 4v+3, one byte
    each; then the scales, then the mins (float16)."""
    k, n = 64, 18
    values = ((np.arange(k)[None, :] * 11 + np.arange(n)[:, None] * 5) % 256).astype(np.uint8)
    scales = np.arange(1, n * k // 32 + 1, dtype=np.float32)
    mins = -np.arange(1, n * k // 32 + 1, dtype=np.float32) / 4
    packed = pack_groups(values.reshape(n, k // 32, 32), scales, k, n, 8, mins)
    assert packed.shape == (2, k // 32, 512 + 64)
    for row in range(32):
        g, i = divmod(row, 16)
        for blk in range(k // 32):
            for v in range(8):
                for j in range(4):
                    want = values[row, 32 * blk + 4 * v + j] if row < n else 0
                    assert packed[g, blk, 64 * v + 4 * i + j] == want
            half = packed[g, blk, 512 + 2 * i: 514 + 2 * i].copy().view("<f2")[0]
            low = packed[g, blk, 544 + 2 * i: 546 + 2 * i].copy().view("<f2")[0]
            assert half == (scales[row * (k // 32) + blk] if row < n else 0)
            assert low == (mins[row * (k // 32) + blk] if row < n else 0)


def test_rewrite_leaves_what_the_op_cannot_run():
    rng = np.random.default_rng(5)
    b, scales = _weights(rng, 128, 8)
    bias = numpy_helper.from_array(np.zeros(8, np.float32), "bias")
    kept = [
        _nbits_model(128, 8, b, scales, 1, level=0),  # float arithmetic asked for
        _nbits_model(128, 8, b, scales, 1, bits=2),  # neither 4 nor 8 bits
        _nbits_model(128, 8, b, scales, 1, extra_inputs=("", "", "bias"), extra_inits=(bias,)),
        _nbits_model(128, 8, b, scales * 1e7, 1),  # float16 cannot hold the scales
    ]
    b80 = rng.integers(0, 256, (8, 3, 16), dtype=np.uint8)  # K = 80: a padded last block
    kept.append(_nbits_model(80, 8, b80, np.ones(24, np.float32) * 0.01, 1))
    b16 = rng.integers(0, 256, (8, 8, 8), dtype=np.uint8)
    kept.append(_nbits_model(128, 8, b16, np.ones(64, np.float32) * 0.01, 1, block=16))
    for model in kept:
        assert rewrite_int4(model, ".", threads=2) == 0
        assert [nd.op_type for nd in model.graph.node] == ["MatMulNBits"]
