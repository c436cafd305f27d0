"""The lookup datastore (runtime/bundle/datastore.py) and `dsc datastore`: the model's own
outputs as a corpus the lookup drafts from where a request's context has no match."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from test_drafting import _seq

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import LookupConfig
from dspark.runtime.bundle.datastore import STORE_FILE, Datastore
from dspark.runtime.drafting.base import DraftWork
from dspark.runtime.drafting.lookup import STORE_FIRST_PRIOR, LookupDrafter
from dspark.runtime.drafting.state import DraftState
from dspark.runtime.errors import BundleError

from cli_helpers import run_dsc


def test_walk_follows_the_longest_suffix_and_the_most_frequent_continuation():
    store = Datastore.build([[1, 2, 3, 4], [9, 2, 3, 5], [7, 3, 5], [8, 2, 3, 5]], max_n=3)
    # "2 3" continued with 5 twice and 4 once; then "2 3 5" is unknown, "3 5" is known
    # (its continuation... none: 5 ends every stream), so the walk stops
    n, tokens, agree = store.walk([6, 2, 3], 4)
    assert (n, tokens, agree) == (2, [5], [pytest.approx(2 / 3)])
    n, tokens, agree = store.walk([1, 2, 3], 4)  # the 3-gram "1 2 3" is known: 4, alone
    assert (n, tokens, agree) == (3, [4], [1.0])
    assert store.walk([42], 4) == (0, [], [])


def test_walk_chains_steps_through_its_own_proposal():
    store = Datastore.build([[1, 2, 3, 4, 5, 6]], max_n=2)
    assert store.walk([0, 1], 3) == (1, [2, 3, 4], [1.0, 1.0, 1.0])


def test_ties_go_to_the_lowest_token_id():
    store = Datastore.build([[1, 7], [1, 3]], max_n=1)
    assert store.walk([1], 1)[1] == [3]


def test_save_and_load_keep_the_table(tmp_path):
    store = Datastore.build([[1, 2, 3, 4, 2, 3, 9], [5, 6]], max_n=4)
    store.save(tmp_path / STORE_FILE)
    again = Datastore.load(tmp_path / STORE_FILE)
    assert again.table == store.table and again.max_n == 4
    assert not list(tmp_path.glob(".*tmp"))  # written through a temp file, renamed


def test_a_damaged_store_is_refused_naming_the_file(tmp_path):
    (tmp_path / STORE_FILE).write_bytes(b"not a zip")
    with pytest.raises(BundleError, match=f"{STORE_FILE}: unreadable lookup datastore"):
        Datastore.load(tmp_path / STORE_FILE)


def test_the_store_only_drafts_where_the_context_has_no_match():
    store = Datastore.build([[40, 41, 42, 43]], max_n=2)
    drafter = LookupDrafter(LookupConfig(min_survival=0.0), store)
    own = _seq([5, 6, 7, 5, 6], seq_id=1)  # "5 6" occurred before: the context's copy wins
    state = DraftState()
    drafter.propose([DraftWork(own, state, 2)])
    assert state.tokens == [7, 5] and not drafter.from_store(own)
    new = _seq([9, 41], seq_id=2)  # no match in its context: the store's 42, 43
    state = DraftState()
    drafter.propose([DraftWork(new, state, 2)])
    assert state.tokens == [42, 43] and drafter.from_store(new)
    assert state.confidence[0] == pytest.approx(STORE_FIRST_PRIOR[1])  # its own prior
    off = LookupDrafter(LookupConfig(min_survival=0.0, use_store=False), store)
    state = DraftState()
    off.propose([DraftWork(_seq([9, 41], seq_id=3), state, 2)])
    assert state.tokens == []


def test_store_matches_learn_apart_from_context_matches():
    store = Datastore.build([[40, 41, 42, 43]], max_n=2)
    drafter = LookupDrafter(LookupConfig(min_survival=0.0), store)
    seq = _seq([9, 41], seq_id=2)
    for _ in range(100):
        drafter.propose([DraftWork(seq, DraftState(), 2)])
        drafter.observe(seq, verified=2, accepted=0)
    assert drafter.stats[True, True].first_rate(1) < 0.05
    assert drafter.stats[True, False].first_rate(1) == pytest.approx(0.15)


@pytest.fixture()
def store_bundle(tok_bundle, tmp_path):
    bundle = shutil.copytree(tok_bundle, tmp_path / "tok.dsmodel")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"chat": f"hello w{i} w{i + 7} world"}) + "\n"
                               for i in range(6)))
    return bundle, prompts


def test_dsc_datastore_adds_a_hashed_store_and_speculation_stays_exact(store_bundle, capsys):
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest

    bundle, prompts = store_bundle
    result = run_dsc(capsys, "datastore", bundle, "--prompts", prompts, "--max-tokens", "24")
    assert result.code == 0, result.err
    assert "n-grams from" in result.out
    b = open_bundle(bundle)
    assert STORE_FILE in b.manifest.files and b.manifest.flags["datastore"]["count"] == 6
    assert len(b.datastore) > 0
    engine, tokenizer = load_engine(bundle, watch=False)
    assert engine.drafting.lookup.store is not None
    # the prompts the store was built from: its drafts are the main's own continuations
    ids = [tuple(tokenizer.encode_chat([{"role": "user", "content": f"hello w{i} w{i + 7} "
                                         "world"}])) for i in range(3)]
    plain = engine.generate([GenerationRequest(x, 24, speculative=False) for x in ids])
    spec = engine.generate([GenerationRequest(x, 24, method="lookup") for x in ids])
    assert [s.generated for s in spec] == [s.generated for s in plain]
    lookup = engine.drafting.lookup
    lookup.config = dataclasses.replace(lookup.config, use_store=False)
    alone = engine.generate([GenerationRequest(x, 24, method="lookup") for x in ids])
    assert [s.generated for s in alone] == [s.generated for s in plain]
    # what the store adds: drafts the context alone did not have
    assert (sum(s.stats.accepted_tokens for s in spec)
            > sum(s.stats.accepted_tokens for s in alone))


def test_a_tampered_store_fails_the_bundles_hash_check(store_bundle, capsys):
    bundle, prompts = store_bundle
    assert run_dsc(capsys, "datastore", bundle, "--prompts", prompts,
                   "--max-tokens", "4").code == 0
    data = bytearray((bundle / STORE_FILE).read_bytes())
    data[-30] ^= 1
    (bundle / STORE_FILE).write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256 does not match"):
        open_bundle(bundle)


def test_dsc_datastore_usage_errors(store_bundle, tmp_path, capsys):
    bundle, _ = store_bundle
    result = run_dsc(capsys, "datastore", bundle, "--prompts", tmp_path / "none.jsonl")
    assert result.code == 2 and "none.jsonl: no such file" in result.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    result = run_dsc(capsys, "datastore", bundle, "--prompts", bad)
    assert result.code != 0 and "bad.jsonl:1" in result.err and "Traceback" not in result.err
    assert STORE_FILE not in open_bundle(bundle).manifest.files
