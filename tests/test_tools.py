"""Tool calling: tools + tool_choice through a grammar, the answer as OpenAI tool_calls,
lossless with speculation, and a round trip with the official openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.tokenizer import load_tokenizer
from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import RequestError
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.grammar.tools import (
    call_schema,
    parse_call,
    parse_calls,
    tool_grammar,
    with_tools,
)
from dspark.runtime.sequence.request import GenerationRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def test_choices_and_calls():
    assert tool_grammar(TOOLS, "none") is None and tool_grammar([], "auto") is None
    assert all(isinstance(tool_grammar(TOOLS, c), str) for c in ("auto", "required", None))
    with pytest.raises(RequestError) as e:
        tool_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice.function.name" and "get_time" in str(e.value)
    call = parse_call('{"name": "get_time", "arguments": {"zone": "utc"}}', TOOLS)
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    raw = parse_call('{"name": "get_time", "arguments": {"zone": "\\u0075tc"}}', TOOLS)
    assert raw["function"]["arguments"] == '{"zone": "\\u0075tc"}'  # as generated
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert parse_call("it is sunny", TOOLS) is None
    assert parse_call('{"name": "other", "arguments": {}}', TOOLS) is None
    assert call_schema({"name": "f"})["properties"]["arguments"]["type"] == "object"


@pytest.mark.parametrize("choice, parallel", [
    ("required", False), ("auto", False),
    ({"type": "function", "function": {"name": "get_weather"}}, False), ("required", True)],
    ids=["required", "auto", "named", "required-parallel"])
def test_tool_grammar_is_lossless_and_calls_are_valid(json_bundle, choice, parallel):
    bundle = open_bundle(json_bundle)
    tokenizer = load_tokenizer(bundle.tokenizer_dir)
    grammar = tool_grammar(TOOLS, choice, parallel)
    prompts = [(5, 6, 7), (9, 8), (40, 41, 42, 43), (100,)]
    requests = [GenerationRequest(p, 80, grammar=grammar, speculative=spec, method="hybrid")
                for spec in (False, True) for p in prompts]
    engine = Engine(bundle, "fixed", 4, eos_ids=tuple(tokenizer.eos_ids), max_batch=8,
                    grammars=GrammarBook.of(bundle, tokenizer))
    seqs = engine.generate(requests)
    for plain, spec in zip(seqs[:4], seqs[4:]):
        assert spec.generated == plain.generated
    calls = 0
    for seq in seqs:
        text = tokenizer.decode(seq.generated)
        if parallel and seq.finish_reason == "length":  # calls until max_tokens: all but
            text = text[: text.rindex("\n")]          # the last, cut one are whole
        found = parse_calls(text, TOOLS)
        if choice == "auto" and found is None:
            assert not text.lstrip().startswith("{")  # an answer in text
            continue
        assert found is not None, text
        assert seq.finish_reason == ("length" if parallel and seq.finish_reason == "length"
                                     else "stop")
        assert parallel or len(found) == 1
        for call in found:
            function = next(t["function"] for t in TOOLS if t["function"]["name"] ==
                            call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                function["parameters"])
            if isinstance(choice, dict):
                assert call["function"]["name"] == "get_weather"
        calls += 1
    if choice != "auto":  # (a random model answers "auto" in text: only the grammar calls)
        assert calls == len(seqs)


def test_tool_calling_round_trip_with_the_openai_client(json_bundle):
    from server_helpers import LiveServer, api_error

    with LiveServer(json_bundle, warmup=False) as live:
        client = live.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "weather in Oslo?"}]
        done = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                              tool_choice="required", max_tokens=80,
                                              temperature=0)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        json.loads(call.function.arguments)
        # the same request streamed: the call's id and name first, then its arguments in
        # pieces as they are generated, joining to the non-streamed call's arguments
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                tool_choice="required", max_tokens=80,
                                                temperature=0, stream=True)
        chunks = [c for c in stream if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
        assert deltas[0].function.arguments == "" and len(deltas) > 2
        assert all(d.index == 0 and d.id is None and d.function.name is None
                   for d in deltas[1:])
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the SDK's stream helper assembles the same call
        with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS,
                                            tool_choice="required", max_tokens=80,
                                            temperature=0) as helper:
            final = helper.get_final_completion()
        [assembled] = final.choices[0].message.tool_calls
        assert (assembled.function.name, assembled.function.arguments) == (
            call.function.name, call.function.arguments)
        # parallel_tool_calls: true: several calls, streamed with one index each; their
        # arguments join to the non-streamed calls' (a call cut by max_tokens: streamed in
        # part, left out of the non-streamed answer)
        many = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                    max_tokens=60, temperature=0, parallel_tool_calls=True)
        whole = client.chat.completions.create(**many).choices[0]
        chunks = [c for c in client.chat.completions.create(**many, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert whole.message.tool_calls
        for i, call_i in enumerate(whole.message.tool_calls):
            assert "".join(d.function.arguments for d in deltas if d.index == i) == \
                call_i.function.arguments
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
        # the round trip: the call and its result go back, the model answers
        follow = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                                tools=TOOLS, tool_choice="none", messages=[
            *messages, {"role": "assistant", "content": None, "tool_calls": [
                call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}])
        assert follow.choices[0].message.tool_calls is None
        assert follow.choices[0].finish_reason == "length"
        named = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert named.choices[0].message.tool_calls[0].function.name == "get_time"
        e = api_error(lambda: client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}}))
        assert e.status_code == 400 and e.body["param"] == "tool_choice.function.name"
        e = api_error(lambda: client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, response_format={"type": "json_object"}))
        assert e.status_code == 400 and e.body["param"] == "response_format"
        e = api_error(lambda: client.completions.create(model=model, prompt="x",
                                                       extra_body={"tools": TOOLS}))
        assert e.status_code == 400 and e.body["param"] == "tools"
        assert live.wait_idle()


def _stream(pieces: list[str]) -> tuple[list[dict], str, list[dict], str, bool]:
    from dspark.runtime.server.tool_calls import CallStream

    calls, text, sent = CallStream(TOOLS), "", []
    for piece in pieces:
        text += calls.text(piece)
        sent += calls.deltas()
    last, rest, called = calls.finish()
    return sent, text, last, rest, called


def test_a_streamed_call_arrives_head_first_then_arguments_in_pieces():
    whole = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    sent, text, last, rest, called = _stream(list(whole))  # one character per step
    assert text == rest == "" and called
    head, *args = sent + last
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert len(args) > 10 and all(set(a) == {"index", "function"} for a in args)
    assert "".join(a["function"]["arguments"] for a in args) == '{"city": "Oslo", "unit": "c"}'
    # cut short (max_tokens): what was sent stays a prefix, no whole call is claimed
    sent, _, last, rest, called = _stream(list(whole[:50]))
    assert not called and rest == ""
    streamed = "".join(d["function"]["arguments"] for d in sent + last)
    assert streamed == whole[whole.index('{"city'):50]
    # an answer in text is sent as text; the call that never started sends nothing
    sent, text, last, rest, called = _stream(["  It is", " sunny"])
    assert (sent, text, last, rest, called) == ([], "  It is sunny", [], "", False)
    # everything in the final step: the whole call in one delta
    sent, _, last, _, called = _stream([whole])
    assert called and sent[0]["function"]["name"] == "get_weather"


def test_parallel_calls_stream_one_index_each():
    first = '{"name": "get_time", "arguments": {"zone": "cet"}}'
    second = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    sent, text, last, rest, called = _stream(list(first + "\n" + second))
    assert called and text == rest == ""
    deltas = sent + last
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_time"),
                                                                    (1, "get_weather")]
    joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
              for i in (0, 1)]
    calls = parse_calls(first + "\n" + second, TOOLS)
    assert joined == [c["function"]["arguments"] for c in calls]
    assert joined == ['{"zone": "cet"}', '{"city": "Oslo", "unit": "c"}']
    assert parse_calls(first + "\nnot a call", TOOLS) is None
    assert "one such object per line" in with_tools([], TOOLS, parallel=True)[0]["content"]
    assert "per line" not in with_tools([], TOOLS)[0]["content"]
