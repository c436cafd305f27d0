"""`dsc verify`: the bundle computes the same function as the models it was compiled from.

Random prompts of mixed lengths are prefilled together in one flattened batch, then several
multi-token steps follow (each sequence appending its own number of tokens); every logit the
bundle's segments + reference SpeculativeVerify produce is compared with the original model
run on that sequence alone, with its own KV-cache I/O.

Some models are not deterministic across shapes: an int4 draft whose MatMulNBits quantizes
activations to int8 (accuracy_level 4) turns 1e-7 input differences into logit differences
near 1. So verify also measures the original's own noise floor, the larger of: the same
tokens in one prefill versus in steps, and, where its MatMulNBits quantize their inputs to
int8, the original against itself computing them in float (what that rounding moves: `dsc
quantize`'s drafts compute their projections in float32 in onnxruntime and only the 8-bit
head rounds, so chunkings alone rarely show it). Only where that floor exceeds the
tolerance is a difference within NOISE_FACTOR times it accepted, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.attention_ref import ReferenceAttention
from dspark.runtime.model.batch import FlatBatch, SeqChunk
from dspark.runtime.model.contiguous_cache import ContiguousKVCache
from dspark.runtime.model.executor import SegmentedModel
from dspark.runtime.model.sessions import make_session

NOISE_FACTOR = 4.0


@dataclass(frozen=True)
class VerifyReport:
    role: str
    max_abs_diff: float
    tokens: int
    steps: int
    argmax_agree: float  # fraction of tokens whose top-1 matches
    noise_floor: float  # the original's own difference between chunkings of the same tokens

    def limit(self, tolerance: float) -> float:
        return max(tolerance, NOISE_FACTOR * self.noise_floor)

    def ok(self, tolerance: float) -> bool:
        return self.max_abs_diff <= self.limit(tolerance)


def _check_matches(bundle: Bundle, role: str, original: OriginalModel, path: Path) -> None:
    spec, c = bundle.model(role), original.contract
    if (c.num_layers, c.num_kv_heads, c.head_dim) != (spec.num_layers, spec.num_kv_heads,
                                                      spec.head_dim):
        raise DSparkError(f"{path}: {c.num_layers} layers x {c.num_kv_heads} kv heads x "
                          f"{c.head_dim} does not match the bundle's {role} model")


def verify_model(bundle: Bundle, role: str, path: Path, seqs: int = 3, steps: int = 4,
                 seed: int = 0) -> VerifyReport:
    rng = np.random.default_rng(seed)
    original = OriginalModel(path)
    _check_matches(bundle, role, original, path)
    spec = bundle.model(role)
    prompts = [int(n) for n in rng.integers(1, 13, seqs)]
    cache = ContiguousKVCache(spec, seqs, max(prompts) + 4 * steps)
    model = SegmentedModel(bundle, role, ReferenceAttention(cache))
    pasts, starts = [original.empty_past() for _ in range(seqs)], [0] * seqs
    history: list[list[int]] = [[] for _ in range(seqs)]
    stepwise: list[list[np.ndarray]] = [[] for _ in range(seqs)]
    worst, tokens, agree = 0.0, 0, 0
    for step in range(steps + 1):
        lens = prompts if step == 0 else [int(n) for n in rng.integers(1, 5, seqs)]
        new = [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in lens]
        batch = FlatBatch.build([SeqChunk(i, starts[i], tuple(new[i])) for i in range(seqs)])
        got = model.forward(batch)
        for i in range(seqs):
            a, b = batch.seq_range(i)
            ref, pasts[i] = original.forward(new[i], pasts[i])
            history[i] += new[i]
            stepwise[i].append(ref)
            worst = max(worst, float(np.abs(got[a:b].astype(np.float64) - ref).max()))
            agree += int((got[a:b].argmax(-1) == ref.argmax(-1)).sum())
            tokens += b - a
            starts[i] += b - a
    noise = max(_chunking_noise(original, history[i], stepwise[i]) for i in range(seqs))
    noise = max(noise, _rounding_noise(path, original, history))
    return VerifyReport(role, worst, tokens, steps, agree / tokens, noise)


def _rounding_noise(path: Path, original: OriginalModel, histories: list[list[int]]) -> float:
    """How far the original's int8-input MatMulNBits (accuracy level 4) move its logits from
    float inputs (accuracy level 0), on the verified tokens; 0 without such ops."""
    model = onnx.load(str(path))
    rounding = [a for n in model.graph.node if n.op_type == "MatMulNBits"
                for a in n.attribute if a.name == "accuracy_level" and a.i == 4]
    if not rounding:
        return 0.0
    for attr in rounding:
        attr.i = 0
    floated = OriginalModel(path, make_session(model.SerializeToString(), level="all"))
    return max(float(np.abs(floated.forward(h, floated.empty_past())[0].astype(np.float64)
                            - original.forward(h, original.empty_past())[0]).max())
               for h in histories)


def _chunking_noise(original: OriginalModel, tokens: list[int], steps: list[np.ndarray]
                    ) -> float:
    once, _ = original.forward(tokens, original.empty_past())
    return float(np.abs(once.astype(np.float64) - np.concatenate(steps)).max())
