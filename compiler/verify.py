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
int8, the original against itself computing them in float (what that rounding moves: `dsc
quantize`'s drafts compute their projections in float32 in onnxruntime and only the 8-bit
head rounds, so chunkings alone rarely show it). Only where that floor exceeds the
tolerance is a difference within NOISE_FACTOR times it accepted, saying so.

A model that quantizes activations per tensor (DynamicQuantizeLinear: onnxruntime's
quantize_dynamic) is causal only a token at a time, so the reference runs it token by token.
Its floor is its per-token form (what the bundle computes, passes/token_quant.py) with every
quantized input moved by one float32 ulp (JITTER), in one prefill against those steps, over
every verified sequence: the int8 rounding carries a difference that small a long way, and
the long sequences show it where the short ones may not (SmolLM2 through quantize_dynamic:
a floor of 4.28 over 2099 tokens, the bundle at 4.52).

The segments run as compiled, float zero points in float32 as in the original: the forms the
runtime hands onnxruntime for speed (MatMulInt4, the split of runtime/model/zero_points.py)
round their inputs to int8, which moves a draft's logits far more than the compiled graph
does (Gemma 3's by ~70x, its top-1 agreement down to 82%): a check that loose would not see
a compile's error. Those forms are tested against the original on their own.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from dspark.compiler.contract import model_file
from dspark.compiler.jitter import computes_in_float16, jittered
from dspark.compiler.kv_rounding import kv_rounded
from dspark.compiler.passes.token_quant import per_token_model
from dspark.compiler.progress import Progress
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
JITTER = 2.0 ** -23  # one float32 ulp: per-tensor quantized models' floor (_whole)


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
                 seed: int = 0, rtol: float = RTOL, kv_dtype: str | None = None,
                 progress: Progress | None = None) -> VerifyReport:
    """`kv_dtype`: check the function of a float16 or int8 cache (`dsrun --kv-cache-dtype`),
    against the original with its cache rounded the same way (compiler/kv_rounding.py).
    `progress`: where the forwards' progress goes (stderr in `dsc verify`)."""
    progress = progress or Progress(quiet=True)
    rng = np.random.default_rng(seed)
    path = model_file(path)
    original = OriginalModel(path)
    if kv_dtype not in (None, "float32"):
        original = OriginalModel(path, make_session(
            kv_rounded(path, kv_dtype).SerializeToString(), level="all"))
    _check_matches(bundle, role, original, path)
    spec = bundle.model(role)
    plans = chunk_plans(spec, rng, seqs, steps)
    cache = ContiguousKVCache(spec, len(plans), max(sum(p) for p in plans), kv_dtype)
    model = SegmentedModel(bundle, role, ReferenceAttention(cache), split_zero_points=False)
    pasts, starts = [original.empty_past() for _ in plans], [0] * len(plans)
    history: list[list[int]] = [[] for _ in plans]
    # the floor: from the short sequences, or from every one for a model quantized per tensor
    # or computing in float16 (its rounding shows in the long ones; the others' floor stays
    # as tight as it was)
    half = computes_in_float16(onnx.load(str(path), load_external_data=False))
    rounding = kv_dtype not in (None, "float32")
    if rounding and (half or original.token_by_token):
        raise DSparkError(f"{path}: --kv-cache-dtype {kv_dtype} is checked on models that "
                          "compute in float32 with float activations only (this one "
                          + ("computes in float16)" if half else "quantizes them per tensor)"))
    floor_seqs = len(plans) if original.token_by_token or half or rounding else seqs
    stepwise: list[list[np.ndarray]] = [[] for _ in plans]
    worst, beyond, tokens, agree = 0.0, 0.0, 0, 0
    forwards, longest = max(len(p) for p in plans), max(sum(p) for p in plans)
    progress.say(f"verify {role}: {len(plans)} sequences, {forwards} forwards, up to "
                 f"{longest} positions")
    # The bundle's forwards first, their logits kept on disk, then the original's: the two
    # models are never in memory together (each may be most of it).
    with tempfile.TemporaryDirectory(prefix="dsc-verify-") as kept:
        chunks = []
        for k in range(forwards):
            progress.tick(f"verify {role}: bundle forward {k + 1}/{forwards}, {max(starts)} of "
                          f"{longest} positions reached")
            live = [i for i, p in enumerate(plans) if k < len(p)]
            new = {i: [int(t) for t in rng.integers(0, spec.vocab_size, plans[i][k])]
                   for i in live}
            batch = FlatBatch.build([SeqChunk(i, starts[i], tuple(new[i])) for i in live])
            np.save(Path(kept) / f"{k}.npy", model.forward(batch))
            chunks.append((live, new, batch))
            for i in live:
                starts[i] += len(new[i])
        del model, cache
        gc.collect()
        for k, (live, new, batch) in enumerate(chunks):
            progress.tick(f"verify {role}: original forward {k + 1}/{forwards}")
            got = np.load(Path(kept) / f"{k}.npy")
            for row, i in enumerate(live):
                a, b = batch.seq_range(row)
                ref, pasts[i] = original.forward(new[i], pasts[i])
                history[i] += new[i]
                if i < floor_seqs:
                    stepwise[i].append(ref)
                diff = np.abs(got[a:b] - ref)
                worst = max(worst, float(diff.max()))
                beyond = max(beyond, float((diff - rtol * np.abs(ref)).max()))
                agree += int((got[a:b].argmax(-1) == ref.argmax(-1)).sum())
                tokens += b - a
    progress.say(f"verify {role}: the original's own noise (whole prompts against chunks)")
    whole = _whole(original, half)
    noise = max(_chunking_noise(whole, history[i], stepwise[i]) for i in range(floor_seqs))
    noise = max(noise, _rounding_noise(path, original, history[:seqs]))
    if rounding:
        noise = max(noise, _kv_noise(path, kv_dtype, original, history))
    return VerifyReport(role, worst, tokens, steps, agree / tokens, noise,
                        max(sum(p) for p in plans), rtol, max(0.0, beyond))


def _whole(original: OriginalModel, half: bool = False) -> OriginalModel:
    """The original running a chunk in one forward. One that quantizes activations per tensor
    runs token by token as the reference; in one forward, what the bundle computes is its
    per-token form (passes/token_quant.py): that form's one forward against the reference's
    steps is how far the int8 rounding carries float differences in this model. One that
    computes in float16 (`half`) runs moved by one float32 ulp (compiler/jitter.py): how far
    the float16 rounding carries them."""
    if half:
        return OriginalModel(original.path, make_session(jittered(original.path), level="all"))
    if not original.token_by_token:
        return original
    model = onnx.load(str(original.path))
    per_token_model(model, original.contract, original.path, jitter=JITTER)
    return OriginalModel(original.path, make_session(model.SerializeToString(), level="all"),
                         token_by_token=False)


def _rounding_noise(path: Path, original: OriginalModel, histories: list[list[int]]) -> float:
    """How far accuracy level 4 (a MatMulNBits' leave to quantize its inputs to int8) moves
    the original's logits, on the verified tokens: the original against itself with float
    inputs (accuracy level 0), and against itself with its projections as the runtime runs
    them (MatMulInt4, int8 inputs, where this CPU has a vector path; onnxruntime keeps float
    zero points in float32). 0 without such ops."""
    def rounding_attrs(model: onnx.ModelProto) -> list:
        return [a for n in model.graph.node if n.op_type == "MatMulNBits"
                for a in n.attribute if a.name == "accuracy_level" and a.i == 4]

    if not rounding_attrs(onnx.load(str(path), load_external_data=False)):
        return 0.0  # (the weights not read: a float main may be most of the memory)
    model = onnx.load(str(path))
    rounding = rounding_attrs(model)
    variants = [OriginalModel(path, session) for session in _int8_sessions(path, model)]
    for attr in rounding:
        attr.i = 0
    variants.append(OriginalModel(path, make_session(model.SerializeToString(), level="all")))
    reference = [original.forward(h, original.empty_past())[0] for h in histories]
    return max(float(np.abs(v.forward(h, v.empty_past())[0].astype(np.float64) - ref).max())
               for v in variants for h, ref in zip(histories, reference))


def _kv_noise(path: Path, kv_dtype: str, original: OriginalModel,
              histories: list[list[int]]) -> float:
    """How far the cache's rounding carries float32 differences: the rounded original
    against itself with every new key and value moved by one float32 ulp before it is
    rounded (a value that close to a rounding boundary flips by a whole float16 ulp or int8
    step, as the bundle's, computed in another order, may)."""
    moved = OriginalModel(path, make_session(
        kv_rounded(path, kv_dtype, JITTER).SerializeToString(), level="all"))
    return max(float(np.abs(moved.forward(h, moved.empty_past())[0].astype(np.float64)
                            - original.forward(h, original.empty_past())[0]).max())
               for h in histories)


def _int8_sessions(path: Path, model: onnx.ModelProto) -> list:
    """The original with its projections as MatMulInt4 on this CPU's best vector path (the
    runtime's arithmetic), when it has one."""
    from dspark.kernels.cpu_op import ISA_PATHS, int4_paths, op_library
    from dspark.runtime.env import kernel_cache_dir, read_env
    from dspark.runtime.model.int4_rows import int4_path, rewrite_int4

    env = read_env()
    library = op_library(kernel_cache_dir(), env.cc).path
    isa = int4_path(int4_paths(library), env.cpu_int4, env.cpu_isa) if library else None
    if isa is None:
        return []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if not rewrite_int4(copy, path.parent, env.threads, ISA_PATHS.index(isa)):
        return []
    return [make_session(copy.SerializeToString(), custom_ops=library)]


def _chunking_noise(original: OriginalModel, tokens: list[int], steps: list[np.ndarray]
                    ) -> float:
    once, _ = original.forward(tokens, original.empty_past())
    return float(np.abs(once.astype(np.float64) - np.concatenate(steps)).max())
