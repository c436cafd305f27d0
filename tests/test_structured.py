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

# grammar logic does not depend on the architecture: the two without sliding windows
PAIRS = [("llama", "classic"), ("llama", "dynamo"), ("gpt2", "classic"), ("gpt2", "dynamo")]
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
    return bundle, tokenizer, GrammarBook.of(bundle, tokenizer)


def _run(bundle, tokenizer, book, requests, **engine_kwargs):
    engine = Engine(bundle, eos_ids=tuple(tokenizer.eos_ids), decode=tokenizer.decode,
                    grammars=book, max_batch=len(requests), **engine_kwargs)
    seqs = engine.generate(requests)
    assert engine.arena.free_blocks == engine.plan.num_blocks
    return seqs


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_constrained_speculation_equals_constrained_plain(json_bundles, pair):
    """Every fixture pair (both export forms), each drafting method, batched."""
    bundle, tokenizer, book = _book(json_bundles[pair])
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(1, 320, n)) for n in (3, 17)]
    grammars = [schema_grammar(s, "schema") for s in BOUNDED]
    cases = [(p, g, s) for p in prompts for g, s in zip(grammars, BOUNDED)]
    requests = [GenerationRequest(p, 120, grammar=g, speculative=method != "plain",
                                  method=None if method == "plain" else method)
                for method in ("plain", "draft", "lookup", "hybrid") for p, g, _ in cases]
    seqs = _run(bundle, tokenizer, book, requests, policy="fixed", window=4)
    plain = seqs[:len(cases)]
    for i, seq in enumerate(seqs):
        assert seq.generated == plain[i % len(cases)].generated
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(seq.generated)),
                            cases[i % len(cases)][2])
    spec = seqs[len(cases):]
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


def test_dsrun_generate_json_schema(json_bundle, tmp_path, capsys):
    from cli_helpers import run_dsrun

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(BOUNDED[3]))
    r = run_dsrun(capsys, "generate", "--model", json_bundle, "--prompt-ids", "5,6,7",
                  "--max-tokens", "120", "--json-schema", schema, "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), BOUNDED[3])
    for text, words in (("{not json", "not a readable JSON file"),
                        (json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}),
                         "nope")):
        schema.write_text(text)
        r = run_dsrun(capsys, "generate", "--model", json_bundle, "--prompt-ids", "5",
                      "--json-schema", schema)
        assert r.code == 2 and words in r.err and str(schema) in r.err
        errors = [x for x in r.err.splitlines() if x and not x.startswith("[dsrun]")]
        assert len(errors) == 1, r.err  # the one error line, after the load's progress


def test_openai_structured_output_over_http(json_bundle):
    """The official client: `parse` with a pydantic model, the same schema streamed, JSON
    mode, and a schema the engine cannot compile (a 400 naming it)."""
    import httpx
    from pydantic import BaseModel, Field
    from server_helpers import LiveServer, api_error

    class Reading(BaseModel):
        sensor: str = Field(max_length=6)
        value: int = Field(ge=-50, le=50)
        ok: bool

    with LiveServer(json_bundle, warmup=False) as live:
        client = live.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "a reading"}]
        done = client.chat.completions.parse(model=model, messages=messages,
                                             response_format=Reading, max_tokens=120,
                                             temperature=0)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Reading)
        schema = {"type": "json_schema", "json_schema": {
            "name": "reading", "schema": Reading.model_json_schema() | {
                "additionalProperties": False}, "strict": True}}
        stream = client.chat.completions.create(model=model, messages=messages, stream=True,
                                                response_format=schema, max_tokens=120,
                                                temperature=0)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert Reading.model_validate_json(text) == choice.message.parsed
        plain = client.chat.completions.create(
            model=model, messages=messages, max_tokens=120, temperature=0,
            response_format=schema, extra_body={"speculative_decoding": False})
        assert plain.choices[0].message.content == text  # speculation changes nothing
        mode = client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                              temperature=0,
                                              response_format={"type": "json_object"})
        assert mode.choices[0].message.content.startswith("{")
        e = api_error(lambda: client.chat.completions.create(
            model=model, messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "nope"}}}}}))
        assert e.status_code == 400 and e.body["param"] == "response_format.json_schema.schema"
        assert "nope" in e.body["message"]
        r = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": model, "messages": messages, "response_format": {"type": "yaml"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
        assert live.wait_idle()


@pytest.mark.slow
def test_first_free_constrained_token_follows_masked_main_distribution(json_bundle,
                                                                        fixture_pairs):
    """Sampled, with forced drafts and the draft model: the first token the grammar leaves
    open is distributed as the main model's softmax masked by the grammar (chi-square over
    3000 seeded sequences); unmasked p fails the same test."""
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.bundle.config import DFlashConfig, VerifyBalanceConfig
    from dspark.runtime.sequence.sampling import probabilities

    from chi_square import chi_square

    bundle, tokenizer, book = _book(json_bundle)
    schema = {"type": "object", "properties": {"v": {"enum": list("abcdefghijk")}},
              "required": ["v"], "additionalProperties": False}
    grammar = schema_grammar(schema, "schema")
    probe = book.constraint(grammar)
    forced = probe.forced()
    probe.commit(forced)
    allowed = probe.allowed()
    assert forced and 3 <= allowed.sum() < 320  # a real choice, and a real constraint
    params = SamplingParams(temperature=1.5)
    prompt = (5, 6, 7)
    main, _ = fixture_pairs[("llama", "classic")]
    model = OriginalModel(main)
    logits, _ = model.forward([*prompt, *forced], model.empty_past())
    p = probabilities(np.where(allowed, logits[-1], -np.inf), params)
    unmasked = probabilities(logits[-1], params)
    engine = Engine(bundle, "fixed", 6, max_batch=512, eos_ids=tuple(tokenizer.eos_ids),
                    grammars=book,
                    config=DFlashConfig(verify_balance=VerifyBalanceConfig(
                        batch_cap=False, batch_modes=False, plain_prompt_steps=False)))
    seqs = engine.generate([GenerationRequest(prompt, len(forced) + 1,
                                              SamplingParams(1.5, seed=i), grammar=grammar,
                                              method="draft") for i in range(3000)])
    assert all(s.generated[:len(forced)] == forced for s in seqs)
    # the prefill round emits the first forced token; the rest are free drafts
    assert sum(s.stats.sources["grammar"].drafted for s in seqs) >= 3000 * (len(forced) - 1)
    tokens = np.array([s.generated[len(forced)] for s in seqs])
    assert allowed[tokens].all()

    masked, plain = chi_square(tokens, p), chi_square(tokens, unmasked)
    print(f"chi-square p-value, masked p: {masked:.3g}; unmasked: {plain:.3g}")
    assert masked > 1e-3 and plain < 1e-6


@pytest.mark.slow
def test_smollm2_structured_output_is_valid_and_lossless(smollm2_bundle):
    """The 22 strict JSON-schema cases of samples/schemas on the real SmolLM2 pair, batched:
    speculation (the default hybrid) gives plain's tokens, and every output validates."""
    from conftest import ROOT

    from dspark.runtime.sequence.prompt import prompt_ids

    bundle, tokenizer, book = _book(smollm2_bundle)
    cases = [json.loads(line) for line in
             (ROOT / "samples" / "schemas" / "structured_cases.jsonl").read_text().splitlines()]
    assert len(cases) >= 20
    requests = [GenerationRequest(tuple(prompt_ids(tokenizer, None, c["prompt"], None)), 160,
                                  grammar=schema_grammar(c["schema"], "schema"),
                                  speculative=spec) for spec in (False, True) for c in cases]
    seqs = _run(bundle, tokenizer, book, requests)
    for plain, spec, case in zip(seqs[:len(cases)], seqs[len(cases):], cases):
        assert spec.generated == plain.generated
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(plain.generated)), case["schema"])
    assert sum(s.stats.accepted_tokens for s in seqs[len(cases):]) > 0
