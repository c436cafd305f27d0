"""Tool calling: OpenAI `tools` + `tool_choice` -> a prompt section and a grammar, and the
generated text back to `tool_calls`.

A call is one JSON object `{"name": ..., "arguments": {...}}`, its arguments following the
function's `parameters` schema (compact JSON, runtime/grammar/formats.py):

    tool_choice "none"         no grammar: the model answers in text
    "auto" (the default)       text, or calls: a grammar whose text branch may not start
                               with "{" (so an answer starting with "{" is a call)
    "required"                 calls of any of the tools
    {"type": "function", "function": {"name": N}}   one call of N

With parallel (the request's parallel_tool_calls: true) an answer may hold several calls,
one per line (compact JSON has no raw newline inside a call); without, exactly one.

Calls are forced into their grammar, so their keys and the function names are free drafts
for speculation like any forced token.
"""

from __future__ import annotations

import json
import re
import uuid

from dspark.runtime.errors import RequestError
from dspark.runtime.grammar.formats import JSON_OPTIONS, schema_grammar

NO_PARAMETERS = {"type": "object", "properties": {}}


def call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or NO_PARAMETERS},
        "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[dict], choice, parallel: bool = False) -> str | None:
    """tools: OpenAI function tools (already shape-checked); choice: tool_choice;
    parallel: parallel_tool_calls (not for a named function: one call of it)."""
    choice = "auto" if choice is None else choice
    if not tools or choice == "none":
        return None
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in "
                               f"tools ({', '.join(f['name'] for f in functions)})",
                               param="tool_choice.function.name")
        functions = named
    schemas = [call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    many = parallel and not isinstance(choice, dict)
    if choice != "auto" and not many:
        return schema_grammar(schema, "tools")
    from llguidance import LLMatcher

    embedded = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    start = "start: calls | text\n" if choice == "auto" else "start: calls\n"
    calls = 'calls: call ("\\n" call)*\n' if many else "calls: call\n"
    return LLMatcher.grammar_from_lark(
        start + calls + "text: /[^{](.|\\n)*/\ncall: %json " + embedded)


def tools_prompt(tools: list[dict], parallel: bool = False) -> str:
    """What the system message says about the tools (for templates without a tools slot)."""
    listing = json.dumps([{k: v for k, v in t["function"].items() if v is not None}
                          for t in tools], ensure_ascii=False)
    several = " To call several, write one such object per line." if parallel else ""
    return ("You can call functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}.' + several +
            " Functions: " + listing)


def with_tools(messages: list[dict], tools: list[dict], parallel: bool = False
               ) -> list[dict]:
    """The tools described in the (first) system message."""
    text = tools_prompt(tools, parallel)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_text(call: dict) -> str:
    """An assistant's earlier tool call, written as the model writes one."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]
    return json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)


# how the grammar writes a call's head (compact JSON, "name" first): what a stream waits for
# before it can announce the call, and after which the arguments' text begins
CALL_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def call_head(text: str) -> tuple[str, int] | None:
    """(function name, where the arguments start) once a call's head is complete."""
    match = CALL_HEAD.match(text)
    return (json.loads(match.group(1)), match.end()) if match else None


def parse_call(text: str, tools: list[dict], call_id: str | None = None) -> dict | None:
    """The OpenAI tool_call in a generated text, or None (an answer in text). `arguments`
    is the generated text of the arguments object (what a stream sent, piece by piece)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    names = {t["function"]["name"] for t in tools}
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(
            obj.get("arguments"), dict):
        return None
    arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    if (head := call_head(text)) is not None:
        raw = text.rstrip()[head[1]:-1]
        if _loads(raw) == obj["arguments"]:
            arguments = raw
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def parse_calls(text: str, tools: list[dict]) -> list[dict] | None:
    """The tool_calls in a generated text (one per line), or None if any line is not one."""
    lines = text.strip().split("\n")
    calls = [parse_call(line, tools) for line in lines]
    return calls if lines and all(c is not None for c in calls) else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
