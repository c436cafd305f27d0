"""`dsc verify`: the bundle computes the same function as the models it was compiled from.

Random prompts of mixed lengths are prefilled together in one flattened batch, then several
multi-token steps follow (each sequence appending its own number of tokens); every logit the
bundle's segments + reference SpeculativeVerify produce is compared with the original model
run on that sequence alone, with its own KV-cache I/O.

Beside those short sequences, every length where the model's attention changes is crossed:
for each attention window W the bundle found, one sequence whose steps cross W and one whose
prefill does, and one sequence whose last step ends at the bundle's last position
(max_seq_len: rotary tables, proven spans). Long prompts are fed in chunks of 256 to 511
tokens, as the runtime prefills them.

Some models are not deterministic across shapes: an int4 draft whose MatMulNBits quantizes
activations to int8 (accuracy_level 4) turns 1e-7 input differences into logit differences
near 1. So verify also measures the original's own noise floor, the larger of: the same
tokens in one prefill versus in steps, and, where its MatMulNBits quantize their inputs to
int8, the original against itself computing them in float and as the runtime does (what
that rounding moves: onnxruntime computes `dsc quantize`'s float zero points in float32 and
only their 8-bit head rounds, so chunkings alone rarely show it), on every verified token:
on SmolLM2's draft the rounding moved logits by 1.5 over the short sequences, by 13.8 over
all of them (a 2048-token one among them). Only where that floor exceeds the tolerance is
a difference within NOISE_FACTOR times it accepted, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from dspark.compiler.contract import model_file
from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.attention_ref import ReferenceAttention
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.contiguous_cache import ContiguousKVCache
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.sessions import make_session

NOISE_FACTOR = 4.0
RTOL = 1e-5  # numpy's allclose default: a few float32 roundings of the logit's size


@dataclass(frozen=True)
class VerifyReport:
    role: str
    max_abs_diff: float
    tokens: int
    steps: int
    argmax_agree: float  # fraction of tokens whose top-1 matches
    noise_floor: float  # the original's own difference between chunkings of the same tokens
    longest: int = 0  # the longest sequence checked (positions)
    rtol: float = RTOL
    beyond_rtol: float = 0.0  # max over logits of |diff| - rtol * |original's logit|

    def limit(self, tolerance: float) -> float:
        return max(tolerance, NOISE_FACTOR * self.noise_floor)

    def ok(self, tolerance: float) -> bool:
        return self.beyond_rtol <= self.limit(tolerance)


def _check_matches(bundle: Bundle, role: str, original: OriginalModel, path: Path) -> None:
    spec, c = bundle.model(role), original.contract
    if (c.num_layers, c.num_kv_heads, c.head_dim) != (spec.num_layers, spec.num_kv_heads,
                                                      spec.head_dim):
        raise DSparkError(f"{path}: {c.num_layers} layers x {c.num_kv_heads} kv heads x "
                          f"{c.head_dim} does not match the bundle's {role} model")


PREFILL_CHUNK = 256


def prefill_chunks(n: int) -> list[int]:
    """A prompt of n tokens as the runtime prefills it: chunks of 256, the last 256-511."""
    if n < 2 * PREFILL_CHUNK:
        return [n]
    full = n // PREFILL_CHUNK - 1
    return [PREFILL_CHUNK] * full + [n - PREFILL_CHUNK * full]


def chunk_plans(spec: ModelSpec, rng: np.random.Generator, seqs: int, steps: int
                ) -> list[list[int]]:
    """Per sequence, the tokens each forward appends: the short random sequences, then those
    crossing each window (steps across it, a prefill across it) and the last position."""
    step = lambda: [int(n) for n in rng.integers(1, 5, steps)]  # noqa: E731
    plans = [[int(rng.integers(1, 13))] + step() for _ in range(seqs)]
    limit = spec.max_positions or 0
    for window in sorted({w for w in spec.windows if w}):
        for prompt in (window - 2, window + 3):
            if prompt > 0 and prompt + 4 * steps <= limit:
                plans.append(prefill_chunks(prompt) + step())
    if limit > 4 * steps:
        plans.append(prefill_chunks(limit - 4 * steps) + [4] * steps)
    return plans


def verify_model(bundle: Bundle, role: str, path: Path, seqs: int = 3, steps: int = 4,
                 seed: int = 0, rtol: float = RTOL) -> VerifyReport:
    rng = np.random.default_rng(seed)
    path = model_file(path)
    original = OriginalModel(path)
    _check_matches(bundle, role, original, path)
    spec = bundle.model(role)
    plans = chunk_plans(spec, rng, seqs, steps)
    cache = ContiguousKVCache(spec, len(plans), max(sum(p) for p in plans))
    model = SegmentedModel(bundle, role, ReferenceAttention(cache))
    pasts, starts = [original.empty_past() for _ in plans], [0] * len(plans)
    # the original computing the same tokens as the runtime may (int8 inputs, module doc)
    variants = _rounding_variants(path)
    variant_pasts = [[v.empty_past() for v in variants] for _ in plans]
    history: list[list[int]] = [[] for _ in plans]
    stepwise: list[list[np.ndarray]] = [[] for _ in plans]
    worst, beyond, tokens, agree, rounding = 0.0, 0.0, 0, 0, 0.0
    for k in range(max(len(p) for p in plans)):
        live = [i for i, p in enumerate(plans) if k < len(p)]
        new = {i: [int(t) for t in rng.integers(0, spec.vocab_size, plans[i][k])] for i in live}
        batch = FlatBatch.build([SeqChunk(i, starts[i], tuple(new[i])) for i in live])
        got = model.forward(batch)
        for row, i in enumerate(live):
            a, b = batch.seq_range(row)
            ref, pasts[i] = original.forward(new[i], pasts[i])
            for j, variant in enumerate(variants):
                out, variant_pasts[i][j] = variant.forward(new[i], variant_pasts[i][j])
                rounding = max(rounding, float(np.abs(out.astype(np.float64) - ref).max()))
            history[i] += new[i]
            if i < seqs:
                stepwise[i].append(ref)
            diff = np.abs(got[a:b] - ref)
            worst = max(worst, float(diff.max()))
            beyond = max(beyond, float((diff - rtol * np.abs(ref)).max()))
            agree += int((got[a:b].argmax(-1) == ref.argmax(-1)).sum())
            tokens += b - a
            starts[i] += b - a
    noise = max(_chunking_noise(original, history[i], stepwise[i]) for i in range(seqs))
    return VerifyReport(role, worst, tokens, steps, agree / tokens, max(noise, rounding),
                        max(sum(p) for p in plans), rtol, max(0.0, beyond))


def _rounding_variants(path: Path) -> list[OriginalModel]:
    """Where the original's MatMulNBits may round their inputs to int8 (accuracy level 4),
    the original computing otherwise, each compared with it on every verified token (the
    long sequences too: the rounding's effect grows with the context): with float inputs
    (accuracy level 0), and with its projections as the runtime runs them (MatMulInt4 where
    this CPU has a vector path; float zero points split as the segments run them;
    onnxruntime runs float zero points themselves in float32). None without such ops."""
    model = onnx.load(str(path))
    rounding = [a for n in model.graph.node if n.op_type == "MatMulNBits"
                for a in n.attribute if a.name == "accuracy_level" and a.i == 4]
    if not rounding:
        return []
    variants = [OriginalModel(path, session) for session in _int8_sessions(path, model)]
    for attr in rounding:
        attr.i = 0
    variants.append(OriginalModel(path, make_session(model.SerializeToString(), level="all")))
    return variants


def _int8_sessions(path: Path, model: onnx.ModelProto) -> list:
    """The original with its projections as the runtime runs them, rounding their inputs to
    int8: MatMulInt4 on this CPU's best vector path when it has one, and float zero points
    split onto onnxruntime's uint8 kernel where the model has them (the segments' form,
    runtime/model/zero_points.py)."""
    from dspark.kernels.cpu_op import ISA_PATHS, int4_paths, op_library
    from dspark.runtime.env import kernel_cache_dir, read_env
    from dspark.runtime.model.int4_rows import int4_path, rewrite_int4
    from dspark.runtime.model.zero_points import split_float_zero_points

    env = read_env()
    library = op_library(kernel_cache_dir(), env.cc).path
    isa = int4_path(int4_paths(library), env.cpu_int4, env.cpu_isa) if library else None
    sessions = []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if isa is not None and rewrite_int4(copy, path.parent, env.threads, ISA_PATHS.index(isa)):
        split_float_zero_points(copy, path.parent)  # any the op did not take
        sessions.append(make_session(copy.SerializeToString(), custom_ops=library))
    copy.CopyFrom(model)
    if split_float_zero_points(copy, path.parent):
        sessions.append(make_session(copy.SerializeToString()))
    return sessions


def _chunking_noise(original: OriginalModel, tokens: list[int], steps: list[np.ndarray]
                    ) -> float:
    once, _ = original.forward(tokens, original.empty_past())
    return float(np.abs(once.astype(np.float64) - np.concatenate(steps)).max())
