"""What a caller asks for (OpenAI `response_format`, a JSON schema file) -> a grammar.

Grammars are llguidance's (a JSON-serialised grammar string): its JSON-schema compiler is
the most complete of the maintained engines and its matcher computes a vocabulary's mask
in tens of microseconds, rolls back, validates a run of draft tokens at once and reports the
tokens the grammar forces (jump-forward drafts). JSON is compact and single-line, with the
separators Python's json.dumps writes (", " and ": "): no free whitespace for a small model
to loop in, and more tokens forced.
"""

from __future__ import annotations

import json

from dspark.runtime.errors import RequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


def schema_grammar(schema: dict, param: str) -> str:
    """A JSON schema as a grammar (its constructs are checked when a matcher is built)."""
    from llguidance import LLMatcher

    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON object (a JSON schema)", param=param)
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{param}: {e}", param=param,
                           code="invalid_json_schema") from None


def response_format_grammar(response_format: dict | None) -> str | None:
    """OpenAI's response_format: text (None), json_object or json_schema."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format.json_schema needs a 'schema' object",
                               param="response_format.json_schema")
        return schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise RequestError(f"response_format.type must be text, json_object or json_schema, got "
                       f"{kind!r}", param="response_format.type")
