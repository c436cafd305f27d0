"""Where a forward spends its time (`dsrun bench --profile`).

A decode step (1 token) and a verify step (k tokens) of one model at a cached context, timed
part by part on the CPU executor:

    feeds | segment 0 (embeddings .. layer 0 q/k/v) | layer segments | last segment (LM head)
          | attention (SpeculativeVerify between segments) | glue (what is left of forward)
or, for a model run as one session with the CPU op inside (fused.py), feeds | the session |
glue; then the same steps on a second set of sessions with onnxruntime's profiler on, for
each op type's share of kernel time (SpeculativeVerify among them when it is inside); and
the weight bytes a step reads, for the GB/s it reaches.
The engine's own cost per token (scheduling, sampling, acceptance, emitting) is a plain
generation's wall time less its forwards.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.fused import FusedModel
from dspark.runtime.model.runner import ModelRunner

SEQ = -100  # below the warm-up probes' ids; no request gets it
GATHERS = ("Gather", "GatherBlockQuantized")  # input 1: the indices, all others by row
WARM = 2  # profiled runs left out of the op shares (a fresh session's first runs allocate)


class Laps:
    """StepClock that keeps each part's seconds."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.parts: dict[str, list[float]] = {"feeds": [], "segment": [], "attention": []}

    def lap(self, kind: str) -> None:
        now = time.perf_counter()
        self.parts[kind].append(now - self.last)
        self.last = now


def weight_bytes(runner: ModelRunner, bundle) -> int:
    """Initializer bytes that one forward of the runner's graph reads whole: all but the
    tables only a gather reads (the embedding, float or block-quantized: a few rows per
    step; a tied head that shares the table reads it whole). The graph is the one the
    runner runs: a fused model's own file (with its projections run as MatMulInt4, the
    packed groups, not the MatMulNBits weights beside them, which its embedding's gather
    alone reads there), else the segments."""
    spec, model = bundle.model(runner.role), runner.model
    if isinstance(model, FusedModel):
        files = [spec.int4_graph_file if model.int4_projections else spec.graph_file]
    else:
        files = [seg.file for seg in spec.segments]
    return sum(_read_whole(onnx.load(str(bundle.path(f)), load_external_data=False).graph)
               for f in files)


def _read_whole(graph) -> int:
    """The initializer bytes of one graph that its nodes read whole (see weight_bytes)."""
    gathers = [n for n in graph.node if n.op_type in GATHERS]
    other = {name for n in graph.node if n.op_type not in GATHERS for name in n.input}
    gathered = {name for n in gathers for i, name in enumerate(n.input) if i != 1} - other
    total = 0
    for t in graph.initializer:
        if t.name in gathered:
            continue
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return total


def _step(runner: ModelRunner, model, context: int, n: int, clock: Laps | None) -> float:
    arena, pool = runner.arena, runner.pool
    arena.reserve(SEQ, pool, context, n)
    batch = FlatBatch.build([SeqChunk(SEQ, context, tuple(range(7, 7 + n)))])
    t0 = time.perf_counter()
    if clock is None:
        model.forward(batch, np.arange(n))
    else:
        clock.last = t0
        model.forward(batch, np.arange(n), clock)
    elapsed = time.perf_counter() - t0
    arena.rollback(SEQ, pool, context)
    return elapsed


def _timed(runner: ModelRunner, context: int, n: int, repeats: int) -> dict:
    cpu = isinstance(runner.model, (SegmentedModel, FusedModel))
    rows = []
    for _ in range(repeats):
        laps = Laps() if cpu else None
        total = _step(runner, runner.model, context, n, laps)
        rows.append((total, laps))
    ms = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    out = {"tokens": n, "total_ms": ms([t for t, _ in rows])}
    if isinstance(runner.model, FusedModel):
        out.update(feeds_ms=ms([laps.parts["feeds"][0] for _, laps in rows]),
                   session_ms=ms([laps.parts["segment"][0] for _, laps in rows]))
        out["glue_ms"] = round(max(0.0, out["total_ms"] - out["feeds_ms"] - out["session_ms"]), 3)
    elif cpu:
        seg = [laps.parts["segment"] for _, laps in rows]
        out.update(
            feeds_ms=ms([laps.parts["feeds"][0] for _, laps in rows]),
            first_segment_ms=ms([s[0] for s in seg]),
            layer_segments_ms=ms([sum(s[1:-1]) for s in seg]),
            last_segment_ms=ms([s[-1] for s in seg]),
            attention_ms=ms([sum(laps.parts["attention"]) for _, laps in rows]),
        )
        parts = ("feeds_ms", "first_segment_ms", "layer_segments_ms", "last_segment_ms",
                 "attention_ms")
        out["glue_ms"] = round(max(0.0, out["total_ms"] - sum(out[k] for k in parts)), 3)
    return out


def _op_shares(runner: ModelRunner, bundle, context: int, sizes: tuple[int, ...],
               repeats: int) -> dict[int, dict]:
    """Per step size (profiled sessions): each op type's share of onnxruntime's kernel time,
    and per forward its kernel ms and its run() ms (the sessions' own work around them)."""
    shares = {}
    with tempfile.TemporaryDirectory(prefix="dsrun-profile-") as tmp:
        for n in sizes:
            prefix = str(Path(tmp) / f"n{n}")
            model = (FusedModel(bundle, runner.role, runner.arena, runner.pool,
                                runner.model.library, profile_prefix=prefix,
                                int4_path=runner.model.int4_path)
                     if isinstance(runner.model, FusedModel) else
                     SegmentedModel(bundle, runner.role, runner.model.attention,
                                    profile_prefix=prefix))
            for _ in range(repeats + WARM):
                _step(runner, model, context, n, None)
            kernel: Counter = Counter()
            runs = 0.0
            for sess in model.sessions:
                events = json.loads(Path(sess.end_profiling()).read_text())
                starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
                cutoff = starts[WARM] if len(starts) > WARM else 0  # first runs allocate
                for event in (e for e in events if e.get("ts", 0) >= cutoff):
                    if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                        kernel[event["args"]["op_name"]] += event["dur"]
                    elif event.get("cat") == "Session" and event["name"] == "model_run":
                        runs += event["dur"]
            total, counted = sum(kernel.values()) or 1, repeats
            shares[n] = {"kernel_ms": round(total / counted / 1000, 3),
                         "run_ms": round(runs / counted / 1000, 3),
                         "ops": {op: round(d / total, 4) for op, d in kernel.most_common()}}
            del model
    return shares


def _engine_overhead(engine, tokens: int) -> dict:
    from dspark.runtime.sequence.request import GenerationRequest

    busy0, t0 = engine.main.busy_s, time.perf_counter()
    [seq] = engine.generate([GenerationRequest(tuple(range(10, 60)), tokens, speculative=False)])
    wall, busy = time.perf_counter() - t0, engine.main.busy_s - busy0
    n = max(1, len(seq.generated))
    return {"tokens": n, "ms_per_token": round(1000 * wall / n, 3),
            "forward_ms_per_token": round(1000 * busy / n, 3),
            "engine_ms_per_token": round(1000 * (wall - busy) / n, 3)}


def profile_engine(engine, context: int = 100, verify_tokens: int = 5, repeats: int = 20,
                   ops: bool = True) -> dict:
    """The profile of the engine's main model (and its draft model, if any)."""
    bundle = engine.bundle
    runners = [engine.main] + ([engine.draft_model] if engine.draft_model else [])
    models = {}
    for runner in runners:
        runner.arena.add_sequence(SEQ)
        try:
            _step(runner, runner.model, 0, context, None)  # fill the context once
            runner.arena.reserve(SEQ, runner.pool, 0, context)
            for _ in range(3):
                _timed(runner, context, 1, 2)
            steps = {"decode": _timed(runner, context, 1, repeats),
                     "verify": _timed(runner, context, verify_tokens, repeats)}
            report = {"weight_bytes": weight_bytes(runner, bundle), "steps": steps,
                      "executor": ("one onnxruntime session, SpeculativeVerify inside"
                                   if isinstance(runner.model, FusedModel) else
                                   f"{len(runner.model.sessions)} onnxruntime segments"
                                   if isinstance(runner.model, SegmentedModel) else
                                   type(runner.model).__name__)}
            for step in steps.values():
                step["gb_per_s"] = round(report["weight_bytes"] / step["total_ms"] / 1e6, 2)
            if ops and isinstance(runner.model, (SegmentedModel, FusedModel)):
                shares = _op_shares(runner, bundle, context, (1, verify_tokens),
                                    max(5, repeats // 2))
                report["op_shares"] = {"decode": shares[1], "verify": shares[verify_tokens]}
            models[runner.role] = report
        finally:
            runner.arena.release(SEQ)
    return {"context": context, "verify_tokens": verify_tokens, "repeats": repeats,
            "models": models, "engine": _engine_overhead(engine, 64)}


def format_profile(p: dict) -> str:
    lines = [f"profile at a cached context of {p['context']} tokens, median of {p['repeats']}"]
    for role, m in p["models"].items():
        lines.append(f"  {role}: {m['weight_bytes'] / 1e6:.1f} MB of weights per forward, "
                     f"{m['executor']}")
        for name, s in m["steps"].items():
            parts = ""
            if "session_ms" in s:
                parts = (f" = feeds {s['feeds_ms']:.2f} + one session (attention inside) "
                         f"{s['session_ms']:.2f} + glue {s['glue_ms']:.2f}")
            elif "attention_ms" in s:
                parts = (f" = feeds {s['feeds_ms']:.2f} + segment 0 {s['first_segment_ms']:.2f}"
                         f" + layers {s['layer_segments_ms']:.2f} + last {s['last_segment_ms']:.2f}"
                         f" + attention {s['attention_ms']:.2f} + glue {s['glue_ms']:.2f}")
            lines.append(f"    {name} ({s['tokens']} tok): {s['total_ms']:.2f} ms{parts}"
                         f"  [{s['gb_per_s']:.1f} GB/s of weights]")
        ratio = m["steps"]["verify"]["total_ms"] / m["steps"]["decode"]["total_ms"]
        lines.append(f"    verify/decode: {ratio:.3f}x")
        for name, shares in m.get("op_shares", {}).items():
            top = ", ".join(f"{op} {100 * v:.1f}%" for op, v in list(shares["ops"].items())[:8])
            lines.append(f"    onnxruntime, {name} (profiled sessions): run() "
                         f"{shares['run_ms']:.2f} ms, kernels {shares['kernel_ms']:.2f}: {top}")
    e = p["engine"]
    lines.append(f"  engine, plain decoding of {e['tokens']} tokens: {e['ms_per_token']:.2f} "
                 f"ms/token = forward {e['forward_ms_per_token']:.2f} + scheduling, sampling, "
                 f"emitting {e['engine_ms_per_token']:.2f}")
    return "\n".join(lines)
