"""Float16 models (onnxruntime's `convert_float_to_float16`, as many ONNX model repositories
ship `model_fp16.onnx`): with float16 cache I/O or with float32 I/O (`keep_io_types`), they
compile, verify within their own float16 noise and decode losslessly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lossless import check_self_drafted
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
)
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

from dspark.compiler.compile import CompileOptions, compile_bundle
from dspark.compiler.jitter import jittered
from dspark.compiler.passes import optimize
from dspark.compiler.progress import Progress
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.errors import UnmappableAttentionError
from dspark.runtime.model.attention_ref import ReferenceAttention
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.contiguous_cache import ContiguousKVCache
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.sessions import make_session

from bundle_cache import compiled

FORMS = {"llama-io16": (("llama", "classic"), False), "llama-io32": (("llama", "classic"), True),
         "gemma3-io32": (("gemma3", "classic"), True), "llama-q4f16": (("llama", "classic"), True),
         "llama-dynamo": (("llama", "dynamo"), True), "llama-sdpa": (("llama", "sdpa"), True),
         "llama-dynamo-attention32": (("llama", "dynamo"), True)}
COMPILED = ["llama-io16", "llama-io32", "gemma3-io32", "llama-q4f16", "llama-sdpa",
            "llama-dynamo-attention32"]


@pytest.fixture(scope="module")
def half(fixture_pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp16")
    out = {}
    for name, (key, keep) in FORMS.items():
        out[name] = root / f"{name}.onnx"
        kept = ["Attention"] if name.endswith("attention32") else []
        model = convert_float_to_float16(onnx.load(str(fixture_pairs[key][0])),
                                         keep_io_types=keep,
                                         op_block_list=[*DEFAULT_OP_BLOCK_LIST, *kept])
        if name.endswith("q4f16"):  # transformers.js's model_q4f16.onnx: 4-bit float16 MatMuls
            quantizer = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
                block_size=32, is_symmetric=True, accuracy_level=4))
            quantizer.process()
            model = quantizer.model.model
        onnx.save(model, str(out[name]))
    return out


def _bundle(path, out, draft=None):
    return open_bundle(compiled(CompileOptions(path, draft, out, max_seq_len=256,
                                               kv_budget_mb=8)))


@pytest.mark.parametrize("name", COMPILED)
def test_a_float16_model_compiles_and_verifies(half, name, tmp_path):
    """Every attention becomes SpeculativeVerify (the Gemma 3 fixture: sliding windows and
    q/k norms; SDPA's NaN guard, its IsNaN run in float16 on the probabilities cast down; the
    dynamo export's ONNX Attention kept in float32 by the conversion), the rotaries fuse
    through the casts and a tied head is stored once, and the bundle is within the original's
    own float16 noise."""
    bundle = _bundle(half[name], tmp_path / "b.dsmodel")
    ops = [n.op_type for n in onnx.load(str(bundle.root / "main" / "model.onnx"),
                                        load_external_data=False).graph.node]
    assert ops.count("SpeculativeVerify") == bundle.model("main").num_layers
    passes = bundle.manifest.stage1["main"]["passes"]
    # float16 cache I/O: its new keys and values are float16, held in a float32 arena exactly
    assert bundle.model("main").kv_dtype == "float32"
    if name in ("llama-io16", "llama-io32", "llama-sdpa"):
        assert passes["rotary_fused"] == 2 * passes["verify_nodes"]
    if name == "gemma3-io32":
        # its head is the embedding, both float16 tables; its rotary is left as it is: the
        # q/k norm's output is read unrounded by x * cos, rounded to float16 by the slices
        # of rotate_half (onnxruntime slices in float16), which no RotaryEmbedding computes
        assert passes["tied_head_shared"] == 1 and passes["rotary_fused"] == 0
    report = verify_model(bundle, "main", half[name], seqs=3, steps=3)
    assert report.ok(1e-3) and report.argmax_agree >= 0.98, report


class _Keys(ReferenceAttention):
    """The reference attention, keeping layer 0's new keys as the op receives them."""

    def __call__(self, op, q, k, v, batch):
        if op.layer == 0:
            self.keys = k.copy()
        return super().__call__(op, q, k, v, batch)


def _first_keys(bundle, ids: list[int]) -> np.ndarray:
    """Layer 0's keys for `ids` as the bundle caches them, [T, kv_heads, head_dim]."""
    spec = bundle.model("main")
    attention = _Keys(ContiguousKVCache(spec, 1, 64))
    SegmentedModel(bundle, "main", attention, split_zero_points=False).forward(
        FlatBatch.build([SeqChunk(0, 0, tuple(ids))]))
    return attention.keys


@pytest.mark.parametrize("pinned", [True, False])
def test_keys_keep_their_float16_rounding(half, tmp_path, monkeypatch, pinned):
    """The cache holds float16 keys, as the original's present does. Loading a model,
    onnxruntime drops a float16 round trip made of casts it inserted itself: unpinned, the
    keys reach the cache unrounded (a float16 ulp off, within verify's floor, so only this
    sees it). Pinned, they are the original's to a float16 ulp (its level-`all` session
    fuses the norms, which moves a float32 ulp and may flip a rounding)."""
    if not pinned:
        monkeypatch.setattr(optimize, "pin_casts", lambda model: 0)
    path = half["llama-io32"]
    out = tmp_path / "b.dsmodel"  # compiled here: the cache would not see the patch
    # as exported (lean off): the token-row layout would put the key's casts, renamed, on
    # either side of the layout ops, and onnxruntime would keep the rounding anyway
    compile_bundle(CompileOptions(path, None, out, max_seq_len=256, kv_budget_mb=8,
                                  lean=False), Progress(quiet=True))
    bundle = open_bundle(out)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 300, 40)]
    original = OriginalModel(path)
    _, past = original.forward(ids, original.empty_past())
    want = past[0][0].transpose(1, 0, 2)  # present.0.key [1, kv, T, d] -> [T, kv, d]
    got = _first_keys(bundle, ids).reshape(want.shape)
    rounded = got.astype(np.float16).astype(np.float32)
    assert np.array_equal(got, rounded) == pinned
    if pinned:
        ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(got - want) <= ulp)


def test_the_floor_is_the_original_itself(half):
    """The jittered original at factor 1 is the original bit for bit (its optimized graph,
    casts pinned, loads as the same function); one ulp moves its logits."""
    path = half["llama-io32"]
    original = OriginalModel(path)
    ids = [5, 17, 42, 8, 99, 3, 61, 2]
    want, _ = original.forward(ids, original.empty_past())
    same = OriginalModel(path, make_session(jittered(path, 1.0), level="all"))
    moved = OriginalModel(path, make_session(jittered(path), level="all"))
    assert np.array_equal(same.forward(ids, same.empty_past())[0], want)
    assert not np.array_equal(moved.forward(ids, moved.empty_past())[0], want)


@pytest.mark.parametrize("name", ["llama-io16", "llama-io32", "llama-q4f16", "llama-sdpa"])
def test_speculation_on_a_float16_model_is_lossless(half, name, tmp_path):
    """The model as its own draft and lookup drafts, batched: the same tokens as plain
    decoding, which are the original's greedy tokens (one fork forgiven: a float32 ulp apart,
    float16 rounding moves a logit by verify's floor). The q4f16 form's float16 MatMulNBits
    stay onnxruntime's: MatMulInt4 takes float32 inputs."""
    path = half[name]
    bundle = _bundle(path, tmp_path / "b.dsmodel", draft=path)
    check_self_drafted(bundle, path)


def test_an_attention_computed_in_float16_is_refused_naming_the_node(half, tmp_path):
    """onnxruntime runs the ONNX Attention natively in float16: SpeculativeVerify does not
    reproduce its rounding."""
    with pytest.raises(UnmappableAttentionError, match=r"layer 0: cannot map attention: "
                       r"Attention node '.*' takes float16 q/k/v: onnxruntime computes it in "
                       r"float16"):
        compiled(CompileOptions(half["llama-dynamo"], None, tmp_path / "b.dsmodel",
                                max_seq_len=256, kv_budget_mb=8))


def test_probabilities_rounded_to_float16_are_refused_naming_the_cast(fixture_pairs, tmp_path):
    """A model casting its probabilities down and back up before the values' MatMul (a
    float16 export's softmax(..., dtype=float32).to(float16)) rounds them there."""
    model = onnx.load(str(fixture_pairs[("llama", "classic")][0]))
    nodes = list(model.graph.node)
    softmax = next(n for n in nodes if n.op_type == "Softmax")
    out = softmax.output[0]
    softmax.output[0] = f"{out}/exact"
    at = nodes.index(softmax) + 1
    nodes[at:at] = [
        onnx.helper.make_node("Cast", [f"{out}/exact"], [f"{out}/half"], "ProbsDown",
                              to=onnx.TensorProto.FLOAT16),
        onnx.helper.make_node("Cast", [f"{out}/half"], [out], "ProbsUp",
                              to=onnx.TensorProto.FLOAT)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    path = tmp_path / "rounded.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnmappableAttentionError, match=r"layer 0: cannot map attention: Cast "
                       r"node 'ProbsDown' rounds the probabilities .* to float16 before"):
        compiled(CompileOptions(path, None, tmp_path / "b.dsmodel", max_seq_len=256,
                                kv_budget_mb=8))


def test_dsc_quantize_refuses_a_float16_main_saying_so(half, tmp_path):
    from dspark.compiler.quantize import quantize_file
    from dspark.runtime.errors import DSparkError

    with pytest.raises(DSparkError, match=r"its weights are float16: quantize the float32 "
                                          r"model it was converted from"):
        quantize_file(half["llama-io32"], tmp_path / "draft.onnx")
    assert not list(tmp_path.iterdir())
