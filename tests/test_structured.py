"""Structured output: JSON schema / JSON mode through llguidance, with speculation.

Lossless: constrained output with speculation (draft model, lookup, hybrid, forced tokens)
equals constrained output without it, token for token; and every output parses and
validates against its schema, on a random fixture model where only the grammar makes it
valid.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.tokenizer import load_tokenizer
from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import RequestError
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.grammar.formats import response_format_grammar, schema_grammar
from dspark.runtime.sequence.request import GenerationRequest
from dspark.runtime.sequence.sampling import SamplingParams

# bounded schemas: a random model stops only where the grammar makes it
BOUNDED = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"enum": ["a", "bb", "ccc"]}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                               "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9,
                                               "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["point", "label"], "additionalProperties": False},
]


def _book(bundle_path):
    bundle = open_bundle(bundle_path)
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    return bundle, tokenizer, GrammarBook(bundle.tokenizer_dir / "tokenizer.json",
                                          bundle.model("main").vocab_size,
                                          frozenset(tokenizer.eos_ids))


def _run(bundle, tokenizer, book, requests, **engine_kwargs):
    engine = Engine(bundle, eos_ids=tuple(tokenizer.eos_ids), decode=tokenizer.decode,
                    grammars=book, max_batch=len(requests), **engine_kwargs)
    seqs = engine.generate(requests)
    assert engine.arena.free_blocks == bundle.plan.num_blocks
    return seqs


@pytest.mark.parametrize("method", ["draft", "lookup", "hybrid"])
def test_constrained_speculation_equals_constrained_plain(json_bundle, method):
    bundle, tokenizer, book = _book(json_bundle)
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(1, 320, n)) for n in (3, 9, 17, 30)]
    grammars = [schema_grammar(s, "schema") for s in BOUNDED]
    requests = [GenerationRequest(p, 120, grammar=g, speculative=spec, method=method)
                for spec in (False, True) for p in prompts for g in grammars]
    seqs = _run(bundle, tokenizer, book, requests, policy="fixed", window=4)
    half = len(seqs) // 2
    for plain, spec in zip(seqs[:half], seqs[half:]):
        assert spec.generated == plain.generated
        assert plain.finish_reason == spec.finish_reason == "stop"
    for seq, schema in zip(seqs, [s for _ in (0, 1) for _ in prompts for s in BOUNDED]):
        jsonschema.validate(json.loads(tokenizer.decode(seq.generated)), schema)
    spec = seqs[half:]
    forced = sum(s.stats.sources["grammar"].drafted for s in spec if "grammar" in
                 s.stats.sources)
    assert forced > 0  # keys and punctuation were proposed without any draft forward
    assert sum(s.stats.accepted_tokens for s in spec) > 0


def test_sampled_constrained_output_is_valid(json_bundle):
    """Rejection sampling against masked p: every sampled output follows its schema."""
    bundle, tokenizer, book = _book(json_bundle)
    requests = [GenerationRequest((5, 6, seed), 120, SamplingParams(temperature=1.0, seed=seed),
                                  grammar=schema_grammar(schema, "schema"), method=method)
                for seed, schema in enumerate(BOUNDED) for method in ("draft", "hybrid")]
    seqs = _run(bundle, tokenizer, book, requests, policy="fixed", window=4)
    for seq, schema in zip(seqs, [s for s in BOUNDED for _ in (0, 1)]):
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(seq.generated)), schema)
    assert sum(s.stats.draft_tokens for s in seqs) > 0


def test_json_mode_and_schema_errors_name_the_construct(json_bundle):
    bundle, tokenizer, book = _book(json_bundle)
    grammar = response_format_grammar({"type": "json_object"})
    [seq] = _run(bundle, tokenizer, book, [GenerationRequest((5, 6), 200, grammar=grammar)])
    if seq.finish_reason == "stop":
        assert isinstance(json.loads(tokenizer.decode(seq.generated)), dict)
    else:  # a random model may fill an open object to max_tokens; it starts like one
        assert tokenizer.decode(seq.generated).startswith("{")
    assert response_format_grammar({"type": "text"}) is None
    with pytest.raises(RequestError) as e:
        book.check(schema_grammar({"type": "object", "properties": {"a": {"type": "nope"}}},
                                  "response_format.json_schema.schema"),
                   "response_format.json_schema.schema")
    assert "nope" in str(e.value) and e.value.param == "response_format.json_schema.schema"
    for bad, param in (({"type": "xml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": [1]}},
                        "response_format.json_schema.schema")):
        with pytest.raises(RequestError) as e:
            response_format_grammar(bad)
        assert e.value.param == param
