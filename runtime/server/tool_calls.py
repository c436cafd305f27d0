"""Chat requests with tools: the prompt (the tools in the system message, earlier calls as
the model writes them), and the answer as OpenAI `tool_calls`, streamed or not.

The grammar (runtime/grammar/tools.py) makes a call a JSON object; with tool_choice "auto"
an answer starting with "{" is a call, so a stream holds its text back until the first
non-space character says which it is. A streamed call arrives as OpenAI streams one: a
delta with its index, id and name once the head `{"name": ..., "arguments": ` is complete,
then the arguments' text in pieces as it is generated (the last character held back: it
may be the call's closing brace); the pieces join to the non-streamed call's `arguments`.
With parallel_tool_calls: true a newline starts the next call, index + 1.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.runtime.grammar.tools import (
    call_head,
    call_text,
    new_call_id,
    parse_calls,
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


def parallel(body) -> bool:
    """Several calls per answer only when asked for. OpenAI's default is true, but a small
    model given the choice repeats its call until max_tokens (SmolLM2-135M did: one right
    call, then the same again, or calls until cut off)."""
    return body.parallel_tool_calls is True


def grammar(body) -> str | None:
    tools = active_tools(body)
    if tools is None:
        return None
    choice = body.tool_choice
    return tool_grammar(tools, choice.model_dump() if hasattr(choice, "model_dump") else choice,
                        parallel(body))


def chat_messages(body, text: Callable[[str, str], str]) -> list[dict]:
    """The messages as the chat template reads them; text(s, param) checks each text."""
    messages = []
    for i, m in enumerate(body.messages):
        parts = [text(m.text(), f"messages[{i}].content")]
        parts += [call_text(c.model_dump()) for c in m.tool_calls or ()]
        messages.append({"role": m.role, "content": "\n".join(p for p in parts if p)})
    tools = active_tools(body)
    return with_tools(messages, tools, parallel(body)) if tools else messages


def answer(text: str, finish: str | None, tools: list[dict] | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason of a complete generation."""
    calls = parse_calls(text, tools) if tools else None
    if calls is not None:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    if tools and finish == "length" and "\n" in text.strip():  # calls, the last one cut
        whole = parse_calls(text.strip().rsplit("\n", 1)[0], tools)
        if whole is not None:
            return {"role": "assistant", "content": None, "tool_calls": whole}, finish
    return {"role": "assistant", "content": text}, finish


class CallStream:
    """Decides, for a stream, whether the text is an answer (sent as it comes) or calls
    (sent as tool_call deltas)."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools or ()}
        self.held = ""
        self.calling = tools is not None
        self.index = 0  # the call being streamed
        self.id: str | None = None  # set once its head is sent
        self.call_at = 0  # where it starts in `held`
        self.args_at = 0  # where its arguments start
        self.args_sent = 0  # characters of its arguments sent
        self.started = False  # a head was sent

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
        """The tool_call deltas to send now: each call's head once complete, then its new
        argument text (up to the newline that ends it; while open, all but the last
        character unless `final`)."""
        out: list[dict] = []
        while self.calling:
            if self.id is None:
                head = call_head(self.held[self.call_at:])
                if head is None or head[0] not in self.names:
                    break
                self.id, self.started = new_call_id(), True
                self.args_at, self.args_sent = self.call_at + head[1], 0
                out.append({"index": self.index, "id": self.id, "type": "function",
                            "function": {"name": head[0], "arguments": ""}})
            end = self.held.find("\n", self.args_at)
            args = (self.held[self.args_at:end - 1] if end >= 0 else
                    self.held[self.args_at:] if final else self.held[self.args_at:-1])
            if len(args) > self.args_sent:
                out.append({"index": self.index,
                            "function": {"arguments": args[self.args_sent:]}})
                self.args_sent = len(args)
            if end < 0:
                break
            self.index, self.id, self.call_at = self.index + 1, None, end
        return out

    def finish(self) -> tuple[list[dict], str, bool]:
        """At the end: (the last deltas, the text still held, whether whole calls were
        made). Calls cut short (max_tokens) keep what was sent, as OpenAI's do."""
        if not self.calling:
            return [], "", False
        if parse_calls(self.held, self.tools) is not None:
            self.held = self.held.rstrip() + "\n"  # the last call ends like the others
            return self.deltas(), "", True
        if self.started:
            return self.deltas(final=True), "", False
        return [], self.held, False
