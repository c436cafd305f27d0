"""Chat requests with tools: the prompt (the tools in the system message, earlier calls as
the model writes them), and the answer as OpenAI `tool_calls`, streamed or not.

The grammar (runtime/grammar/tools.py) makes a call a JSON object; with tool_choice "auto"
an answer starting with "{" is a call, so a stream holds its text back until the first
non-space character says which it is. A streamed call arrives as OpenAI streams one: a
delta with its id and name once the head `{"name": ..., "arguments": ` is complete, then
the arguments' text in pieces as it is generated (the last character held back: it may be
the call's closing brace); the pieces join to the non-streamed call's `arguments`.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.runtime.grammar.tools import (
    call_head,
    call_text,
    new_call_id,
    parse_call,
    tool_grammar,
    with_tools,
)
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
    """Decides, for a stream, whether the text is an answer (sent as it comes) or a call
    (sent as tool_call deltas)."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.held = ""
        self.calling = tools is not None
        self.id: str | None = None  # set once the call's head is sent
        self.args_at = 0  # where the arguments start in `held`
        self.args_sent = 0  # characters of the arguments sent

    def text(self, delta: str) -> str:
        """What to send now of this text delta, as text."""
        if not self.calling:
            return delta
        self.held += delta
        start = self.held.lstrip()
        if start and not start.startswith("{"):
            self.calling, out, self.held = False, self.held, ""
            return out
        return ""

    def deltas(self, final: bool = False) -> list[dict]:
        """The tool_call deltas to send now: the head once complete, then new argument text
        (all of it when `final`, else all but the last character)."""
        if not self.calling:
            return []
        out = []
        if self.id is None:
            head = call_head(self.held)
            if head is None or head[0] not in {t["function"]["name"] for t in self.tools}:
                return []
            self.id, self.args_at = new_call_id(), head[1]
            out.append({"index": 0, "id": self.id, "type": "function",
                        "function": {"name": head[0], "arguments": ""}})
        args = self.held[self.args_at:] if final else self.held[self.args_at:-1]
        if len(args) > self.args_sent:
            out.append({"index": 0, "function": {"arguments": args[self.args_sent:]}})
            self.args_sent = len(args)
        return out

    def finish(self) -> tuple[list[dict], str, bool]:
        """At the end: (the call's last deltas, the text still held, whether a whole call
        was made). A call cut short (max_tokens) keeps what was sent, as OpenAI's does."""
        if not self.calling:
            return [], "", False
        call = parse_call(self.held, self.tools, self.id)
        if call is not None:
            args = call["function"]["arguments"]
            if self.id is None:  # head and arguments in the last delta
                return ([{"index": 0, **call}], "", True)
            rest = args[self.args_sent:]
            return ([{"index": 0, "function": {"arguments": rest}}] if rest else [], "", True)
        if self.id is not None:
            return self.deltas(final=True), "", False
        return [], self.held, False
