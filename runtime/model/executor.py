"""Runs one compiled model: its onnxruntime segments with SpeculativeVerify ops between them.

    input_ids, position_ids
      -> segment 0 -> q0 k0 v0 -> SpeculativeVerify(layer 0) -> out0
      -> segment 1 -> q1 k1 v1 -> SpeculativeVerify(layer 1) -> out1
      ...
      -> segment L -> logits [T, vocab]
The attention backend owns the KV cache; the executor only routes tensors.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

import numpy as np

from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, LOGITS_INDEX, POSITION_IDS, VerifyOp
from dspark.runtime.model.batch import FlatBatch
from dspark.runtime.model.layout import attend_rows
from dspark.runtime.model.sessions import EXTERNAL_FOLDER, make_session
from dspark.runtime.model.zero_points import fast_zero_points

_ORT_INT = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


def id_input_types(sessions) -> dict[str, type]:
    """The integer type (int64 unless the graph says int32) of the input_ids and
    position_ids the sessions take."""
    return {i.name: _ORT_INT.get(i.type, np.int64) for s in sessions for i in s.get_inputs()
            if i.name in (INPUT_IDS, POSITION_IDS)}


class AttentionBackend(Protocol):
    """q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads, dim] (see layout.py)."""

    def __call__(self, op: VerifyOp, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 batch: FlatBatch) -> np.ndarray: ...


class StepClock(Protocol):
    """Told when each segment's onnxruntime run and its attention ops end (profiling)."""

    def lap(self, kind: str) -> None: ...


def segment_session(path, profile_prefix: str | None = None, split_zero_points: bool = True):
    """A segment's session; float zero points in the form onnxruntime runs fast unless
    `split_zero_points` is False (as compiled: `dsc verify`)."""
    model = fast_zero_points(path) if split_zero_points else None
    if model is None:
        return make_session(path, profile_prefix=profile_prefix)
    return make_session(model, profile_prefix=profile_prefix,
                        config={EXTERNAL_FOLDER: str(path.parent)})


class SegmentedModel:
    def __init__(self, bundle: Bundle, role: str, attention: AttentionBackend,
                 profile_prefix: str | None = None, split_zero_points: bool = True):
        """`profile_prefix`: sessions write onnxruntime profiles there (dsrun bench --profile);
        `split_zero_points`: float zero points as onnxruntime runs them fast (zero_points.py;
        False: as compiled)."""
        self.spec = bundle.model(role)
        self.attention = attention
        self.sessions = [segment_session(bundle.path(s.file), profile_prefix, split_zero_points)
                         for s in self.spec.segments]
        self.ops_after: dict[int, list[VerifyOp]] = defaultdict(list)
        for op in self.spec.verify_ops:
            self.ops_after[op.after_segment].append(op)
        self.steps = [(sess, list(seg.outputs), list(seg.inputs), self.ops_after[seg.index])
                      for seg, sess in zip(self.spec.segments, self.sessions)]
        self.input_types = id_input_types(self.sessions)

    def forward(self, batch: FlatBatch, rows: np.ndarray | None = None,
                clock: StepClock | None = None) -> np.ndarray:
        """Logits [len(rows), vocab] for the chosen token rows of the flattened batch
        (default: every row). Bundles whose graph takes `logits_index` compute only those."""
        types = self.input_types
        env: dict[str, np.ndarray] = {
            INPUT_IDS: batch.token_ids[None].astype(types.get(INPUT_IDS, np.int64)),
            POSITION_IDS: batch.positions[None].astype(types.get(POSITION_IDS, np.int64)),
        }
        selects = LOGITS_INDEX in self.spec.inputs
        if selects:
            env[LOGITS_INDEX] = np.arange(batch.num_tokens) if rows is None else rows
        if clock is not None:
            clock.lap("feeds")
        for sess, outputs, inputs, ops in self.steps:
            env.update(zip(outputs, sess.run(outputs, {n: env[n] for n in inputs})))
            if clock is not None:
                clock.lap("segment")
            for op in ops:
                env[op.out] = attend_rows(self.attention, op, env[op.q], env[op.k], env[op.v],
                                          batch)
            if clock is not None and ops:
                clock.lap("attention")
        logits = env[LOGITS][0]
        return logits if rows is None or selects else logits[rows]
