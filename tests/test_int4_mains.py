"""Low-bit mains in every format the ecosystem writes, as `dsc compile`'s MAIN: onnxruntime's
MatMulNBits symmetric (no zero points) and with uint8 zero points, at 4 and 8 bits, and
`dsc quantize`'s float zero points (onnxruntime-genai's int4 builds, with their
GatherBlockQuantized embedding, are in test_genai_models.py). Each verifies against itself
as exported, and generates the same greedy tokens with and without speculation.

The runtime runs their projections as MatMulInt4 (each row of x alone, the same bits in a
decode step and a verify window), the original as MatMulNBits, whose int8 inputs turn 1e-7
differences into logit differences of ~0.5 on these random models (`dsc verify`'s noise
floor): against the original's own greedy loop a fork is forgiven where its top-1/top-2 gap
is within that floor, as two chunkings of the original itself would fork."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lossless import first_fork

from dspark.compiler.compile import CompileOptions
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest

from bundle_cache import compiled

# name -> (bits, symmetric); "min4": dsc quantize's float zero points
FORMATS = {"sym4": (4, True), "zp4": (4, False), "sym8": (8, True), "zp8": (8, False),
           "min4": (4, None)}


def quantized_main(src, out, bits: int, symmetric: bool | None):
    if symmetric is None:
        from dspark.compiler.quantize import quantize_file

        quantize_file(src, out)
        return out
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=32,
                                 is_symmetric=symmetric, accuracy_level=4)
    quant.process()
    onnx.save(quant.model.model, str(out))
    return out


@pytest.fixture(scope="module")
def low_bit(fixture_pairs, tmp_path_factory):
    """{format: (bundle, main.onnx)}: the llama fixture's main in that format, its fp32
    draft beside it."""
    main, draft = fixture_pairs[("llama", "classic")]
    root = tmp_path_factory.mktemp("lowbit")
    out = {}
    for name, (bits, symmetric) in FORMATS.items():
        path = quantized_main(main, root / f"{name}.onnx", bits, symmetric)
        out[name] = (compiled(CompileOptions(path, draft, root / f"{name}.dsmodel",
                                             max_seq_len=256, kv_budget_mb=8)), path)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_low_bit_main_has_its_format_and_verifies(low_bit, name):
    bundle_path, path = low_bit[name]
    bits, symmetric = FORMATS[name]
    nodes = [n for n in onnx.load(str(path), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    projections = nodes[:-1]  # the last is the head (dsc quantize's: 8 bits, symmetric)
    assert nodes and all(next(a.i for a in n.attribute if a.name == "bits") == bits
                         for n in projections)
    zero_points = {len(n.input) > 3 and bool(n.input[3]) for n in projections}
    assert zero_points == {symmetric is not True}
    report = verify_model(open_bundle(bundle_path), "main", path, seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 256, report


@pytest.mark.parametrize("name", list(FORMATS))
def test_low_bit_main_generates_its_own_greedy_tokens(low_bit, name):
    bundle_path, path = low_bit[name]
    bundle, original = open_bundle(bundle_path), OriginalModel(path)
    assert Engine(bundle).main.model.int4_projections > 0  # MatMulInt4, on a vector path
    noise = verify_model(bundle, "main", path, seqs=3, steps=3).noise_floor
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (1, 4, 9, 23)]
    refs = [original.greedy(p, 40) for p in prompts]
    plain = None
    for speculative, window, method in ((False, 1, "draft"), (True, 4, "draft"),
                                        (True, 8, "hybrid")):
        engine = Engine(bundle, "fixed", window, max_batch=4)
        seqs = engine.generate([GenerationRequest(tuple(p), 40, speculative=speculative,
                                                  method=method) for p in prompts])
        got = [s.generated for s in seqs]
        plain = plain or got
        assert got == plain, (speculative, window)  # speculation never changes the output
    for p, g, r in zip(prompts, plain, refs):
        first_fork(g, r, p, original, set(), "length", tie=max(noise, 1e-4))


def test_without_matmulint4_float_zero_points_run_split_and_generate_their_tokens(
        low_bit, monkeypatch):
    """DSPARK_CPU_INT4=0 (as on a CPU without MatMulInt4's paths): dsc quantize's float zero
    points reach onnxruntime rounded to uint8 plus what the rounding moved (zero_points.py),
    not as its float32 float-zero-point kernel, and the main still generates its own tokens."""
    from dspark.runtime.model.fused import fused_graph
    from dspark.runtime.model.sessions import make_session
    from dspark.runtime.model.zero_points import split_float_zero_points

    monkeypatch.setenv("DSPARK_CPU_INT4", "0")
    bundle_path, path = low_bit["min4"]
    bundle, original = open_bundle(bundle_path), OriginalModel(path)
    spec = bundle.model("main")
    model = onnx.load_from_string(fused_graph(bundle, "main", (spec.num_kv_heads, 16,
                                                               spec.head_dim))[0])
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    inits = {t.name: t for t in model.graph.initializer}
    assert nbits and not any(len(n.input) > 3 and n.input[3] and inits[n.input[3]].data_type
                             in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                             for n in nbits)
    assert sum(n.name.endswith("/add_shift") for n in model.graph.node) == len(nbits) - 1
    engine = Engine(bundle, "fixed", 4, max_batch=4)
    assert engine.main.model.int4_projections == 0
    rng = np.random.default_rng(12)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (2, 7, 19)]
    outputs = [[s.generated for s in Engine(bundle, "fixed", 4, max_batch=4).generate(
        [GenerationRequest(tuple(p), 32, speculative=spec_on, method="hybrid")
         for p in prompts])] for spec_on in (False, True)]
    assert outputs[0] == outputs[1]
    # how far the split's int8 inputs move the original's logits on these very tokens
    split = onnx.load(str(path))
    assert split_float_zero_points(split, path.parent)
    split = OriginalModel(path, make_session(split.SerializeToString()))
    noise = max(float(np.abs(split.forward(p + g, split.empty_past())[0]
                             - original.forward(p + g, original.empty_past())[0]).max())
                for p, g in zip(prompts, outputs[0]))
    for p, g in zip(prompts, outputs[0]):
        first_fork(g, original.greedy(p, 32), p, original, set(), "length",
                   tie=max(noise, 1e-4))


def test_projections_are_packed_at_compile_time_not_at_load(low_bit, monkeypatch):
    """dsc compile packs the groups (compiler/int4_stage.py) into the bundle's int4.bin,
    listed and hash-checked like every file; a load only sets each node's path and threads,
    the graph it hands onnxruntime holds no weights (packing is made to fail here), and the
    groups are read into memory and handed to the session."""
    import dspark.runtime.model.int4_rows as int4_rows
    from dspark.runtime.model.fused import fused_graph

    bundle_path, _ = low_bit["zp4"]
    bundle = open_bundle(bundle_path)
    spec = bundle.model("main")
    assert spec.int4_graph_file == "main/model_int4.onnx"
    assert {"main/model_int4.onnx", "main/int4.bin"} <= set(bundle.manifest.files)

    def no_packing(*args, **kwargs):
        raise AssertionError("packed at load")

    monkeypatch.setattr(int4_rows, "pack_groups", no_packing)
    graph, count = fused_graph(bundle, "main", (spec.num_kv_heads, 16, spec.head_dim), "avx2")
    model = onnx.load_from_string(graph)
    int4 = [n for n in model.graph.node if n.op_type == "MatMulInt4"]
    assert count == len(int4) > 0
    assert all({a.name for a in n.attribute} >= {"isa", "isa_few", "threads"} for n in int4)
    groups = [t for t in model.graph.initializer if t.name.endswith("/int4_groups")]
    assert len(groups) == len(int4)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL and t.external_data[0].value
               == "int4.bin" for t in groups)
    assert all(len(t.raw_data) < 1024 for t in model.graph.initializer)  # weights: files
    model = Engine(bundle).main.model
    assert model.int4_projections == count
    # read into our memory and handed over in place (mapped, a step ran 1-5% slower)
    handed, _ = model.session.dspark_initializers
    assert set(handed) == {t.name for t in groups}
    assert all(a.flags.c_contiguous and a.dtype == np.uint8 for a in handed.values())


def test_the_profile_counts_the_weights_the_running_graph_reads(low_bit, monkeypatch):
    """`dsrun bench --profile`'s bytes per forward are those of the graph that runs: with
    MatMulInt4, its packed groups in place of the MatMulNBits weights (the segments' count
    put the MatMulNBits layout there: an int4 SmolLM2 read 127.3 MB, not its 97.1), and
    without it the MatMulNBits weights; every other initializer the same either way."""
    from dspark.runtime.cli.profile import weight_bytes
    from dspark.runtime.model.fused import packed_groups

    bundle_path, _ = low_bit["zp4"]
    bundle = open_bundle(bundle_path)
    packed = Engine(bundle).main
    assert packed.model.int4_projections > 0
    groups = sum(a.nbytes for a in packed_groups(bundle, "main").values())
    monkeypatch.setenv("DSPARK_CPU_INT4", "0")
    nbits = Engine(bundle).main
    assert nbits.model.int4_projections == 0
    graph = onnx.load(str(bundle.path(bundle.model("main").graph_file)),
                      load_external_data=False).graph
    sizes = {t.name: int({e.key: e.value for e in t.external_data}.get("length",
                                                                       len(t.raw_data)))
             for t in graph.initializer}
    projections = sum(sizes[name] for n in graph.node if n.op_type == "MatMulNBits"
                      for name in set(n.input[1:]) if name in sizes)
    assert groups != projections  # two layouts: the test tells the counts apart
    assert weight_bytes(packed, bundle) == weight_bytes(nbits, bundle) - projections + groups
