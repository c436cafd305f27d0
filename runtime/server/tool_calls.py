"""Chat requests with tools: the prompt (the tools in the system message, earlier calls as
the model writes them), and the answer as OpenAI `tool_calls`, streamed or not.

The grammar (runtime/grammar/tools.py) makes a call a JSON object; with tool_choice "auto"
an answer starting with "{" is a call, so a stream holds its text back until the first
non-space character says which it is. A call is sent whole, in one delta, when complete.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.runtime.grammar.tools import call_text, parse_call, tool_grammar, with_tools
from dspark.runtime.server.protocol import ChatCompletionRequest


def active_tools(body) -> list[dict] | None:
    """A chat request's tools, unless there are none or tool_choice is "none" (tools on
    /v1/completions are refused as unsupported)."""
    if (not isinstance(body, ChatCompletionRequest) or not body.tools
            or body.tool_choice == "none"):
        return None
    return [t.model_dump() for t in body.tools]


def grammar(body) -> str | None:
    tools = active_tools(body)
    if tools is None:
        return None
    choice = body.tool_choice
    return tool_grammar(tools, choice.model_dump() if hasattr(choice, "model_dump") else choice)


def chat_messages(body, text: Callable[[str, str], str]) -> list[dict]:
    """The messages as the chat template reads them; text(s, param) checks each text."""
    messages = []
    for i, m in enumerate(body.messages):
        parts = [text(m.text(), f"messages[{i}].content")]
        parts += [call_text(c.model_dump()) for c in m.tool_calls or ()]
        messages.append({"role": m.role, "content": "\n".join(p for p in parts if p)})
    tools = active_tools(body)
    return with_tools(messages, tools) if tools else messages


def answer(text: str, finish: str | None, tools: list[dict] | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason of a complete generation."""
    call = parse_call(text, tools) if tools else None
    if call is not None:
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish


class CallStream:
    """Decides, for a stream, whether the text is an answer (sent as it comes) or a call."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.held = ""
        self.calling = tools is not None

    def text(self, delta: str) -> str:
        """What to send now of this text delta."""
        if not self.calling:
            return delta
        self.held += delta
        start = self.held.lstrip()
        if start and not start.startswith("{"):
            self.calling, out, self.held = False, self.held, ""
            return out
        return ""

    def finish(self) -> tuple[dict | None, str]:
        """At the end: the call, or None and the text still held."""
        call = parse_call(self.held, self.tools) if self.calling else None
        return call, "" if call else self.held
