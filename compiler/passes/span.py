"""Each layer's attention span, read off the running model at lengths that cross it.

SpeculativeVerify attends a query at position p over the keys at p-W+1 .. p (a window of W
positions, its own included) or 0 .. p (W = 0). Which one a layer computes is decided by its
mask arithmetic, which exporters write in many ways (an additive mask built from Range, Less
and Where chains, a bool mask into ONNX Attention). The probe runs that arithmetic rather
than parse it:

    eager      scores = Q.K^T (the score MatMul), pre = the Softmax's input
               key visible <=> pre == scores * scale        (the mask added 0, or Where kept it)
               key masked  <=> pre <= scores * scale - 1e4  (exp underflows to 0 in float32)
    Attention  its mask input (bool: True is visible; float: 0 visible, <= -1e4 masked) and
               is_causal (upper-left aligned, as the ONNX spec defines it)
Anything else (a bias: ALiBi, relative positions, a soft mask) is refused, naming the node.
Every query row's visible keys must be one run ending at the query's own position; a run
shorter than the position allows is the window, and it must be the same in every row, head
and probe. Probed at the short shapes, at the longest length the bundle serves (where a
window shows), then at shapes straddling each window found: steps across it and a prefill
across it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from dspark.compiler.max_length import LengthLimitError
from dspark.compiler.passes.attention import AttentionMatch, SpanSource
from dspark.compiler.passes.probe import PROBE_SHAPES, Prober, ProbeRunError, ProbeShape
from dspark.runtime.errors import UnmappableAttentionError

MASKED = 1e4  # how far below its score a masked key must be pushed (exp(-1e4) is 0)
LONG_NEW = 4  # query rows of the long probe


def span_tensors(matches: list[AttentionMatch]) -> list[str]:
    """The tensors the span probe reads, to expose as outputs."""
    names = []
    for m in matches:
        names += [n for n in (m.span.scores, m.span.masked) if n] if m.span else []
    return names


@dataclass
class SpanRows:
    """What a layer's query rows showed: the windows seen, the longest run not cut."""

    windows: set
    longest_full: int = 0

    def record(self, visible: np.ndarray, shape: ProbeShape, fail) -> None:
        """Check every query row (of `visible` [heads, new, past+new]) is one run of keys
        ending at its own position; note its length."""
        if not (visible == visible[:1]).all():
            raise fail("its heads see different keys")
        for j, row in enumerate(visible[0]):
            p = shape.past + j
            keys = np.flatnonzero(row)
            if not len(keys) or keys[-1] != p or keys[-1] - keys[0] + 1 != len(keys):
                seen = f"{keys[0]}..{keys[-1]} ({len(keys)} keys)" if len(keys) else "no keys"
                raise fail(f"the query at position {p} sees {seen}, not a run of keys ending "
                           "at its own position (not causal, or not a sliding window)")
            if keys[0] == 0:
                self.longest_full = max(self.longest_full, len(keys))
            else:
                self.windows.add(len(keys))

    def window(self, fail) -> int:
        """The window all rows agree on (0: none cut any row)."""
        if not self.windows:
            return 0
        if len(self.windows) > 1:
            raise fail(f"its queries see the last {sorted(self.windows)} keys: not a sliding "
                       "window (chunked or dilated attention?)")
        window = next(iter(self.windows))
        if self.longest_full > window:
            raise fail(f"a window of {window} keys at some positions, {self.longest_full} "
                       "earlier keys at others: not a sliding window")
        return window


def _fail(path: Path, layer: int, node: str, why: str) -> UnmappableAttentionError:
    return UnmappableAttentionError(
        f"{path}: layer {layer}: cannot prove the attention span of node '{node}': {why}")


def _rows(x: np.ndarray, shape: ProbeShape, what: str, fail) -> np.ndarray:
    """x [..., new, past+new] -> [heads, new, past+new] (leading axes broadcast/flattened)."""
    total = shape.past + shape.new
    if x.ndim < 2 or x.shape[-1] != total or x.shape[-2] not in (1, shape.new):
        raise fail(f"its {what} has shape {x.shape}, not [..., {shape.new}, {total}]")
    x = np.broadcast_to(x, (*x.shape[:-2], shape.new, total))
    return x.reshape(-1, shape.new, total)


def _visible_eager(span: SpanSource, sample: dict, shape: ProbeShape, fail) -> np.ndarray:
    scores = _rows(sample[span.scores], shape, "score", fail).astype(np.float64) * span.factor
    if span.softcap:
        scores = span.softcap * np.tanh(scores / span.softcap)
    pre = _rows(sample[span.masked], shape, "Softmax input", fail).astype(np.float64)
    kept = np.abs(pre - scores) <= 1e-5 * np.abs(scores) + 1e-6
    masked = pre <= scores - MASKED
    if not (kept | masked).all():
        j, i = np.argwhere(~(kept | masked))[0][1:]
        raise fail(f"it adds {float((pre - scores)[:, j, i].max()):.4g} to query {j}'s score "
                   f"of key {i}: a bias, not a mask (ALiBi, relative positions?)")
    return kept


def _visible_attention(span: SpanSource, sample: dict, shape: ProbeShape, fail) -> np.ndarray:
    total = shape.past + shape.new
    if span.masked is None:
        visible = np.ones((1, shape.new, total), bool)
    else:
        mask = _rows(sample[span.masked], shape, "mask", fail)
        if mask.dtype == bool:
            visible = mask
        else:
            visible, masked = mask == 0, mask <= -MASKED
            if not (visible | masked).all():
                raise fail("its float mask holds values that are neither 0 nor a mask "
                           "(<= -1e4): a bias")
    if span.causal:  # ONNX: key i visible to query j iff i <= j, whatever the past
        visible = visible & (np.arange(total)[None, :] <= np.arange(shape.new)[:, None])
    return visible


class SpanProbe:
    """Runs the probe shapes and keeps what each layer's rows showed."""

    def __init__(self, prober: Prober, matches: list[AttentionMatch], path: Path):
        self.prober, self.matches, self.path = prober, matches, path
        self.rows = [SpanRows(set()) for _ in matches]
        self.names = span_tensors(matches)

    def fail(self, m: AttentionMatch):
        node = m.span.node if m.span else m.terminal.name
        return lambda why: _fail(self.path, m.layer, node, why)

    def run(self, shape: ProbeShape) -> None:
        sample = self.prober.run(self.names, shape) if self.names else {}
        for m, rows in zip(self.matches, self.rows):
            fail = self.fail(m)
            if m.span is None:
                raise fail("the compiler found no mask for it")
            visible = (_visible_eager if m.span.scores else _visible_attention)(
                m.span, sample, shape, fail)
            rows.record(visible, shape, fail)

    def windows(self) -> list[int]:
        return [rows.window(self.fail(m)) for m, rows in zip(self.matches, self.rows)]


def _runs(prober: Prober, length: int) -> str | None:
    """None if the model runs with `length` positions, else onnxruntime's first line."""
    try:
        prober.run([], ProbeShape(1, length - LONG_NEW, LONG_NEW))
    except ProbeRunError as e:
        return e.reason
    return None


def _check_length(prober: Prober, path: Path, length: int) -> None:
    """Refuse, with the longest length it runs at, a model that cannot run `length` positions
    (learned position tables: GPT-2's 1024 rows)."""
    error = _runs(prober, length)
    if error is None:
        return
    good, bad = LONG_NEW, length
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _runs(prober, mid) is None else (good, mid)
    raise LengthLimitError(
        f"{path}: the model does not run at {length} positions (onnxruntime: {error[:200]}); "
        f"it runs up to {good}: compile with --max-seq-len {good} or less", good)


# A prefill across a window exposes [heads, W, W] scores twice: above this window the steps
# across it are probed alone (the mask is one function of query and key positions either way).
PREFILL_PROBE_MAX = 1024


def straddling(window: int) -> list[ProbeShape]:
    """Steps that cross `window` (past just below it) and a prefill that crosses it."""
    shapes = [ProbeShape(1, max(0, window - 3), 6)]
    if window <= PREFILL_PROBE_MAX:
        shapes.append(ProbeShape(1, 0, window + 2))
    return shapes


def find_spans(prober: Prober, matches: list[AttentionMatch], path: Path,
               max_positions: int) -> list[int]:
    """Each layer's window (0: every earlier key), proven at every probe up to
    `max_positions` (the bundle's max_seq_len) and across each window found."""
    if max_positions > LONG_NEW:
        _check_length(prober, path, max_positions)
    probe = SpanProbe(prober, matches, path)
    longest = ProbeShape(1, max(0, max_positions - LONG_NEW), min(LONG_NEW, max_positions))
    for shape in (*PROBE_SHAPES, longest):
        if shape.past + shape.new <= max_positions:
            probe.run(shape)
    found = sorted({w for w in probe.windows() if w})
    for window in found:
        for shape in straddling(window):
            if shape.past + shape.new <= max_positions:
                probe.run(shape)
    return probe.windows()


def exposed_types(graph: gs.Graph, matches: list[AttentionMatch], elem) -> dict[str, int]:
    """name -> onnx elem type of the span tensors (for Prober's outputs)."""
    tensors = graph.tensors()
    return {n: elem(tensors[n]) for n in span_tensors(matches)}
