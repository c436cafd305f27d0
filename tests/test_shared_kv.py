"""A draft model with the main's cache geometry and token ids reads the main's KV cache
(drafting.share_main_kv): no prompt prefill, no catch-up, output still the main's alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from dspark.compiler.reference import OriginalModel
from dspark.kernels.cpu_op import int4_paths
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine, shared_kv_roles
from dspark.runtime.model.int4_rows import int4_path
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.sampling import SamplingParams


@pytest.fixture(scope="module")
def self_draft(self_bundle):
    """(main.onnx, bundle): the llama fixture as its own draft (conftest's self_bundle)."""
    return self_bundle[1], self_bundle[0]


def _engine(path, share: bool, **kw) -> Engine:
    bundle = open_bundle(path)
    drafting = dataclasses.replace(bundle.config.drafting, share_main_kv=share)
    return Engine(bundle, "fixed", 4, max_batch=4,
                  config=dataclasses.replace(bundle.config, drafting=drafting), **kw)


def test_only_a_draft_with_the_mains_cache_shares_it(self_draft, compiled):
    assert shared_kv_roles(open_bundle(self_draft[1]), True) == {"draft"}
    assert shared_kv_roles(open_bundle(self_draft[1]), False) == frozenset()
    for pair, path in compiled.items():  # the fixtures' drafts are smaller models
        assert shared_kv_roles(open_bundle(path), True) == frozenset(), pair


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_shared_cache_is_lossless_and_skips_the_prompt(self_draft, method):
    main, path = self_draft
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (3, 17, 40)]
    original = OriginalModel(main)
    runs = {}
    for share in (True, False):
        engine = _engine(path, share)
        seqs = engine.generate([GenerationRequest(tuple(p), 24, method=method)
                                for p in prompts])
        for p, seq in zip(prompts, seqs):
            assert seq.generated == original.greedy(p, 24), (share, method)
        assert engine.arena.free_blocks == engine.plan.num_blocks
        runs[share] = (engine.draft_models["draft"].tokens,
                       sum(s.stats.draft_tokens + s.stats.rounds for s in seqs))
    (shared, bound), (own, _) = runs[True], runs[False]
    # sharing, the draft never reads a prompt: per round the main's newest token and drafts
    assert 0 < shared <= bound
    if method == "draft":  # its own cache: every prompt read first (the hybrid may skip one)
        assert own >= sum(map(len, prompts))


def test_identical_draft_on_the_mains_cache_proposes_the_mains_tokens(self_draft):
    """The main model as its own draft, reading the main's own K/V: its greedy proposals
    are the main's (near-ties aside), so nearly every draft is accepted."""
    _, path = self_draft
    engine = _engine(path, True)
    [seq] = engine.generate([GenerationRequest(tuple(range(5, 30)), 40, method="draft")])
    assert seq.stats.draft_tokens >= 20
    assert seq.stats.accepted_tokens >= 0.95 * seq.stats.draft_tokens


def test_shared_cache_sampling_runs(self_draft):
    _, path = self_draft
    engine = _engine(path, True)
    request = GenerationRequest(tuple(range(5, 20)), 24, method="draft",
                                sampling=SamplingParams(temperature=0.8, seed=3))
    [seq] = engine.generate([request])
    assert len(seq.generated) == 24 and seq.stats.accepted_tokens > 0


def test_a_shared_draft_gets_no_pool_and_the_main_gets_its_bytes(self_draft):
    """Sharing, the draft never writes a cache of its own: the engine's plan drops its pool
    and, within the bundle's budget, gives the main twice the blocks (same geometry)."""
    path = self_draft[1]
    bundle = open_bundle(path)
    shared, own = _engine(path, True), _engine(path, False)
    assert own.plan.roles == ("main", "draft")
    assert own.plan.num_blocks == bundle.plan.num_blocks
    assert own.plan.total_bytes == bundle.plan.total_bytes
    assert shared.plan.roles == ("main",)
    assert shared.plan.num_blocks >= 2 * bundle.plan.num_blocks
    assert shared.plan.total_bytes <= bundle.plan.budget_bytes
    assert shared.arena.buffer.numel() == shared.plan.total_bytes
    assert shared.plan.max_seqs >= 2 * bundle.plan.max_seqs


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_int4_copy_on_the_mains_cache_runs_matmulint4_and_stays_lossless(int4_self_bundle,
                                                                          method):
    """The self-speculative int4 copy: its projections run as MatMulInt4 on the CPU's best
    vector path (runtime/model/int4_rows.py), the fp32 main has none; output is the main's."""
    path, main = int4_self_bundle
    bundle = open_bundle(path)
    engine = _engine(path, True)
    draft = engine.draft_models["draft"].model
    assert engine.main.model.int4_projections == 0
    graph = onnx.load(str(bundle.path(bundle.model("draft").graph_file)), load_external_data=False)
    nbits = sum(n.op_type == "MatMulNBits" for n in graph.graph.node)
    assert nbits > 0 and draft.int4_projections == (nbits if draft.int4_path else 0)
    # q/k/v and gate/up, with their float zero points (the Q4_1 mins), joined: 2 + 1 a layer
    layers = bundle.model("draft").num_layers
    assert bundle.manifest.stage1["draft"]["passes"]["projections_joined"] == 3 * layers
    assert draft.int4_path == int4_path(int4_paths(draft.library), True, None)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (4, 19, 33)]
    seqs = engine.generate([GenerationRequest(tuple(p), 24, method=method) for p in prompts])
    original = OriginalModel(main)
    for p, seq in zip(prompts, seqs):
        assert seq.generated == original.greedy(p, 24)
    assert sum(s.stats.accepted_tokens for s in seqs) > 0
