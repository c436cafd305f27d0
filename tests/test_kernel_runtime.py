"""The DSpark kernels inside the runtime: the engine running every SpeculativeVerify through
the Triton kernels (KV injection + verify attention over the arena) stays lossless; rollback
zeroing clears exactly the rejected slots; the device choice fails clearly.

On the CPU the kernels run under Triton's interpreter (the GPU's launches, slowly), so the
prompts here are short; the same test runs compiled on a GPU machine (test_gpu.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import (
    CacheHealthConfig,
    DFlashConfig,
    ResourceConfig,
    ResourceRow,
)
from dspark.runtime.cache.kv_arena import KVArena
from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.device import resolve_device
from dspark.runtime.sequence.request import GenerationRequest

from cli_helpers import run_dsrun

ZEROING = DFlashConfig(resources=ResourceConfig(table=(ResourceRow("cpu", 8),)),
                       cache_health=CacheHealthConfig(zero_rejected_slots=True))


def generate(bundle, prompts, max_tokens, **engine_kwargs):
    engine = Engine(bundle, "fixed", 4, max_batch=4, config=ZEROING, **engine_kwargs)
    seqs = engine.generate([GenerationRequest(tuple(p), max_tokens, method="draft")
                            for p in prompts])
    assert engine.arena.free_blocks == engine.plan.num_blocks
    return engine, seqs


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path")
@pytest.mark.parametrize("pair", [("llama", "classic"), ("gpt2", "dynamo")],
                         ids=lambda p: "-".join(p))
def test_engine_on_kernels_is_lossless(fixture_pairs, compiled, pair):
    bundle = open_bundle(compiled[pair])
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (1, 6, 19)]
    engine, seqs = generate(bundle, prompts, 20, kernels=True)
    assert engine.main.model.attention.library.source == "interpreter"
    original = OriginalModel(fixture_pairs[pair][0])
    for p, seq in zip(prompts, seqs):
        assert seq.generated == original.greedy(p, 20)
    assert sum(s.stats.draft_tokens for s in seqs) > sum(s.stats.accepted_tokens for s in seqs)


def test_rollback_zeroes_exactly_the_rejected_slots(compiled):
    bundle = open_bundle(compiled[("llama", "classic")])
    arena = KVArena(bundle.plan)
    arena.add_sequence(0)
    arena.reserve(0, "main", 0, 40)
    pool, draft = arena.pools["main"], arena.pools["draft"]
    for t in pool.k + pool.v + draft.k + draft.v:
        t.fill_(1.0)
    arena.rollback(0, "main", 30)  # zeroing off: an O(1) length change
    assert all(bool((t != 0).all()) for t in pool.k + pool.v)
    arena.zero_rejected = True
    arena.rollback(0, "main", 21)
    bs, blocks = arena.block_size, arena.tables[0].blocks["main"]
    for t in pool.k + pool.v:
        for pos in range(40):
            cleared = not t[blocks[pos // bs], :, pos % bs].any()
            assert cleared == (21 <= pos < 30), pos
    assert all(bool((t != 0).all()) for t in draft.k + draft.v)  # the other pool


def test_rejected_slots_are_zeroed_during_generation(compiled):
    """With zero_rejected_slots the engine clears rejected drafts, and output is unchanged."""
    bundle = open_bundle(compiled[("llama", "classic")])
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    plain = Engine(bundle, "fixed", 4, max_batch=4).generate(
        [GenerationRequest(tuple(p), 24, method="draft") for p in prompts])
    engine = Engine(bundle, "fixed", 4, max_batch=4, config=ZEROING)
    calls = []
    original = engine.arena.zero_slots
    engine.arena.zero_slots = lambda *a: (calls.append(a), original(*a))
    seqs = engine.generate([GenerationRequest(tuple(p), 24, method="draft") for p in prompts])
    assert [s.generated for s in seqs] == [s.generated for s in plain]
    assert calls and all(start < end for _, _, start, end in calls)


def test_config_switch_reaches_the_arena(compiled):
    bundle = open_bundle(compiled[("llama", "classic")])
    engine = Engine(bundle, "fixed", 4)
    assert not engine.arena.zero_rejected
    engine.apply_config(dataclasses.replace(engine.config, cache_health=CacheHealthConfig(
        zero_rejected_slots=True)))
    assert engine.arena.zero_rejected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_without_cuda_is_a_clear_usage_error(compiled, capsys):
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(DSparkError, match="--device cuda: torch .* sees no CUDA device"):
        resolve_device("cuda")
    r = run_dsrun(capsys, "generate", "--model", str(compiled[("llama", "classic")]),
                  "--prompt-ids", "1,2,3", "--device", "cuda")
    assert r.code == 2 and "--device cuda" in r.err and "Traceback" not in r.err
    r = run_dsrun(capsys, "generate", "--model", str(compiled[("llama", "classic")]),
                  "--prompt-ids", "1,2,3", "--device", "tpu")
    assert r.code == 2 and "'tpu' is not one of" in r.err
