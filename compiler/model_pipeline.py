"""Stages 1 and 2 for one model: optimize, SpeculativeVerify rewrite, segments, weights."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from dspark.compiler.contract import InputContract
from dspark.compiler.int4_stage import write_int4_graph
from dspark.compiler.lazy_weights import import_lazy
from dspark.compiler.passes.attention import AttentionMatch, find_attentions
from dspark.compiler.passes.bind import Meaning, bind_removed_inputs, classify, int_candidates
from dspark.compiler.passes.fold_shapes import fold_shapes, reshaped, shape_derived
from dspark.compiler.passes.gqa import (
    gqa_failure,
    gqa_layers,
    gqa_nodes,
    measured_window,
    replace_gqa,
)
from dspark.compiler.passes.length_switch import fold_length_switches
from dspark.compiler.passes.optimize import optimize
from dspark.compiler.passes.positions import check_per_token_positions
from dspark.compiler.passes.probe import PROBE_SHAPES, Prober
from dspark.compiler.passes.projections import fuse_projections
from dspark.compiler.passes.rotary import fuse_rotary
from dspark.compiler.passes.segments import SegmentCut, cut_segments, segment_graph
from dspark.compiler.passes.select_logits import select_logits_rows
from dspark.compiler.passes.sink_transpose import sink_head_transposes
from dspark.compiler.passes.span import exposed_types, find_spans
from dspark.compiler.passes.tied_head import share_quantized_tied_head, share_tied_head
from dspark.compiler.passes.verify_layout import token_major_verify
from dspark.compiler.passes.verify_nodes import (
    LayerGeometry,
    cache_dtype,
    detach_kv_outputs,
    geometry_from_probe,
    insert_verify_nodes,
)
from dspark.compiler.progress import Progress
from dspark.compiler.weights import open_store
from dspark.runtime.bundle.spec import (
    LOGITS,
    VERIFY_DOMAIN,
    VERIFY_OP,
    ModelSpec,
    Segment,
    VerifyOp,
)
from dspark.runtime.errors import UnmappableAttentionError

_KV_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
              onnx.TensorProto.BFLOAT16: "bfloat16"}


def _elem(t: gs.Tensor) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype or np.float32))


def _vocab_guess(graph: gs.Graph) -> int:
    logits = next(t for t in graph.outputs if t.name == LOGITS)
    dim = logits.shape[-1] if logits.shape else None
    return dim if isinstance(dim, int) and dim > 0 else 32


class ModelAnalysis:
    """What the probe tells about one model: geometry per layer, meanings, vocab size."""

    def __init__(self, opt_path: Path, contract: InputContract, graph: gs.Graph,
                 matches: list[AttentionMatch], max_positions: int):
        removed = set(contract.removed_inputs)
        candidates = int_candidates(graph, removed)
        shapes = {**shape_derived(graph), **reshaped(graph)}
        expose = {**shapes, **candidates}
        for m in matches:
            expose.update({t.name: _elem(t) for t in (m.q, m.k_new, m.v_new, m.out)})
        expose[LOGITS] = onnx.TensorProto.FLOAT
        spans = exposed_types(graph, matches, _elem)
        prober = Prober(opt_path, contract, {**expose, **spans}, _vocab_guess(graph))
        prober.check_causal()
        self.windows = find_spans(prober, matches, contract.path, max_positions)
        samples = prober.run_all(sorted(expose))
        self.vocab_size = int(samples[0][LOGITS].shape[-1])
        self.geometry = [geometry_from_probe(contract, m, samples, PROBE_SHAPES) for m in matches]
        self.meanings: dict[str, Meaning] = {}
        for name in candidates:
            meaning = classify([s[name] for s in samples], PROBE_SHAPES)
            if meaning is not None:
                self.meanings[name] = meaning
        self.shape_samples = {name: [s[name] for s in samples] for name in shapes}


@dataclass
class Rewritten:
    geometry: list[LayerGeometry]
    windows: list[int]  # each layer's attention window (0: every earlier position)
    vocab_size: int
    counts: dict[str, int]  # what each pass changed, for the compile report
    kv_dtype: str  # the arena's type for this model (verify_nodes.cache_dtype)


def _attention(graph: gs.Graph, contract: InputContract, role: str, opt_path: Path,
               max_positions: int
               ) -> tuple[ModelAnalysis, list[LayerGeometry], list[int], int, str]:
    """Every attention becomes SpeculativeVerify: the analysis, each layer's geometry and
    window, and how many nodes. onnxruntime-genai's GroupQueryAttention has its own rewrite
    (passes/gqa.py); every other form is matched by its cache plumbing (passes/attention.py)."""
    if gqa_nodes(graph):
        layers = gqa_layers(graph, contract.head_dim, contract.num_layers, contract.path)
        analysis = ModelAnalysis(opt_path, contract, graph, [], max_positions)
        windows = [measured_window(g, max_positions, gqa_failure(contract.path, g))
                   for g in layers]
        geometry = [LayerGeometry(g.heads, g.kv_heads, g.head_dim) for g in layers]
        return (analysis, geometry, windows, replace_gqa(graph, layers, windows, role),
                _KV_DTYPES.get(contract.kv_dtype, "float32"))
    matches = find_attentions(graph, contract)
    analysis = ModelAnalysis(opt_path, contract, graph, matches, max_positions)
    kv = cache_dtype(onnx.helper.tensor_dtype_to_np_dtype(contract.kv_dtype), matches)
    count = insert_verify_nodes(graph, matches, analysis.geometry, analysis.windows, role, kv)
    return analysis, analysis.geometry, analysis.windows, count, kv.name


def rewrite(graph: gs.Graph, contract: InputContract, role: str, progress: Progress,
            opt_path: Path, max_positions: int, lean: bool = True) -> Rewritten:
    analysis, geometry, windows, nodes, kv_dtype = _attention(graph, contract, role, opt_path,
                                                              max_positions)
    counts = {
        "verify_nodes": nodes,
        "sliding_window_layers": sum(1 for w in windows if w),
        "kv_outputs_detached": detach_kv_outputs(graph),
    }
    graph.cleanup()
    counts["length_switches_folded"] = fold_length_switches(graph, contract, max_positions,
                                                            contract.path)
    counts["inputs_bound"] = bind_removed_inputs(graph, set(contract.removed_inputs),
                                                 analysis.meanings, role, contract.path)
    graph.cleanup().toposort()
    check_per_token_positions(graph, max_positions, contract.path)
    if lean:
        counts["shapes_folded"] = fold_shapes(graph, analysis.shape_samples, role)
        counts["transposes_sunk"] = sink_head_transposes(graph)
        counts["rotary_fused"], unfused = fuse_rotary(graph, role, max_positions)
        counts["rotary_unfused"] = len(unfused)
        if unfused:
            progress.say(f"{role}: rotary left unfused (runs as exported): "
                         + "; ".join(unfused[:3]) + (" ..." if len(unfused) > 3 else ""))
        counts["verify_token_major"] = token_major_verify(graph)
        counts["projections_joined"] = fuse_projections(graph)
    counts["logits_rows_selected"] = select_logits_rows(graph)
    counts["tied_head_shared"] = share_tied_head(graph) or share_quantized_tied_head(graph)
    graph.toposort()
    progress.say(f"{role}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return Rewritten(geometry, windows, analysis.vocab_size, counts, kv_dtype)


def _uniform(geometry: list[LayerGeometry], contract: InputContract) -> LayerGeometry:
    if len(set(geometry)) != 1:
        raise UnmappableAttentionError(
            f"{contract.path}: layers differ in heads/head_dim ({sorted(set(geometry))}); "
            "the unified KV arena needs one geometry per model"
        )
    return geometry[0]


def _export(graph: gs.Graph) -> onnx.ModelProto:
    model = gs.export_onnx(graph, do_type_check=False)
    model.producer_name, model.producer_version = "dspark", ""
    return model


# onnxruntime's own ops in the ONNX domain (onnxruntime-genai's builder writes them); the
# checker does not know them, onnxruntime does
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def check_segment(path: Path, model: onnx.ModelProto) -> None:
    """onnx.checker on a segment, its ops in the ONNX domain that only onnxruntime defines
    aside (the checker stops at the first op it does not know)."""
    ours = [n for n in model.graph.node if n.domain in ("", "ai.onnx")
            and n.op_type in ORT_DEFAULT_DOMAIN_OPS]
    if not ours:
        onnx.checker.check_model(str(path))
        return
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    # each becomes an Identity of its first input, in its place: same names, same order
    keep = [onnx.helper.make_node("Identity", n.input[:1], n.output[:1], name=n.name)
            if n.domain in ("", "ai.onnx") and n.op_type in ORT_DEFAULT_DOMAIN_OPS else n
            for n in stripped.graph.node]
    del stripped.graph.node[:]
    stripped.graph.node.extend(keep)
    check = path.with_suffix(".check.onnx")  # beside it: its weights resolve the same way
    try:
        onnx.save(stripped, str(check))
        onnx.checker.check_model(str(check))
    finally:
        check.unlink(missing_ok=True)


def write_model(graph: gs.Graph, cuts: list[SegmentCut], role: str, out: Path,
                progress: Progress | None = None, source: Path | None = None
                ) -> tuple[tuple[Segment, ...], str, str]:
    """Segments and the whole graph, all pointing into one weights.bin (`progress`: a line
    every few seconds with the segments and the weights written; `source`: the folder of
    the files the graph's weights stayed in, lazy_weights.py)."""
    progress = progress or Progress(quiet=True)
    folder = out / role
    folder.mkdir()
    f, store = open_store(folder / "weights.bin", source)
    segments = []
    with f:
        for cut in cuts:
            rel = f"{role}/segment_{cut.index:03d}.onnx"
            model = _export(segment_graph(graph, cut))
            store.externalize(model)
            onnx.save(model, str(out / rel))
            check_segment(out / rel, model)
            segments.append(Segment(cut.index, rel, tuple(t.name for t in cut.inputs),
                                    tuple(t.name for t in cut.outputs)))
            progress.tick(f"write {role}: segment {len(segments)}/{len(cuts)}, "
                          f"{f.tell() / 2**20:.0f} MiB of weights written")
        whole = _export(graph)
        whole.opset_import.append(onnx.helper.make_opsetid(VERIFY_DOMAIN, 1))
        store.externalize(whole)
        onnx.save(whole, str(folder / "model.onnx"))
    return tuple(segments), f"{role}/model.onnx", f"{role}/weights.bin"


def op_counts(nodes) -> dict[str, int]:
    return dict(sorted(Counter(n.op if isinstance(n, gs.Node) else n.op_type
                               for n in nodes).items()))


def compile_model(contract: InputContract, role: str, work: Path, out: Path,
                  progress: Progress, max_positions: int, lean: bool = True
                  ) -> tuple[ModelSpec, dict]:
    """The model's spec and its stage-1 report (ops before and after, pass counts).
    `max_positions`: rotary tables cover positions below it (the bundle's max_seq_len);
    `lean`: run the shape-folding and rotary passes."""
    before = op_counts(onnx.load(str(contract.path), load_external_data=False).graph.node)
    with progress.stage(f"optimize {role}"):
        opt_path = optimize(contract, work, role)
        graph = import_lazy(opt_path)
    with progress.stage(f"verify-nodes {role}"):
        done = rewrite(graph, contract, role, progress, opt_path, max_positions, lean)
        geo = _uniform(done.geometry, contract)
        cuts, after = cut_segments(graph)
    with progress.stage(f"write {role}"):
        segments, graph_file, weights_file = write_model(graph, cuts, role, out, progress,
                                                         opt_path.parent)
    with progress.stage(f"pack {role}"):
        int4_graph_file = write_int4_graph(out, graph_file)
    ops = []
    for node in sorted((n for n in graph.nodes if n.op == VERIFY_OP),
                       key=lambda n: n.attrs["layer"]):
        q, k, v = (t.name for t in node.inputs)
        ops.append(VerifyOp(node.name, int(node.attrs["layer"]), q, k, v, node.outputs[0].name,
                            geo.num_heads, geo.num_kv_heads, geo.head_dim, node.attrs["scale"],
                            after[node.name], node.attrs.get("layout", "heads"),
                            node.attrs["window"], float(node.attrs.get("softcap", 0.0))))
    report = {"ops_before": before, "ops_after": op_counts(graph.nodes), "passes": done.counts}
    return ModelSpec(
        role=role, num_layers=contract.num_layers, num_heads=geo.num_heads,
        num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, vocab_size=done.vocab_size,
        kv_dtype=done.kv_dtype,
        inputs=tuple(t.name for t in graph.inputs), graph_file=graph_file,
        weights_file=weights_file, segments=segments, verify_ops=tuple(ops),
        max_positions=max_positions, int4_graph_file=int4_graph_file,
    ), report
