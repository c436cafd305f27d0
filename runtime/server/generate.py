"""The completion endpoints' work: a request's choices built and submitted, then answered
whole or streamed (server-sent events), each choice with its text, finish reason, tool calls
and logprobs (choices.py), and the usage of all of them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dspark.runtime.errors import RequestError
from dspark.runtime.grammar.formats import response_format_grammar
from dspark.runtime.sequence.processors import Penalties
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.sampling import SamplingParams
from dspark.runtime.sequence.validate import draft_role
from dspark.runtime.server import choices, errors, tool_calls, waiting
from dspark.runtime.server.admission import RETRY_HEADER, retry_count
from dspark.runtime.server.errors import APIError
from dspark.runtime.server.protocol import GenerationParams, SpeculativeConfig
from dspark.runtime.server.service import Handle
from dspark.runtime.server.state import ServerState
from dspark.runtime.server.streaming import TextStream


def requests_of(state: ServerState, body: GenerationParams, ids: list[int], tenant: str,
                prompt_param: str, grammar: str | None = None) -> list[GenerationRequest]:
    """The request's choices (`n`, seeds seed, seed + 1, ...); their bounds are checked
    in validate(), at the engine's door (the one path the CLI uses too)."""
    if (name := body.unsupported()) is not None:
        raise APIError(400, f"{name} is not supported by this server", param=name,
                       code="unsupported_parameter")
    if body.model != state.model_id:
        raise APIError(404, f"the model '{body.model}' does not exist (this server serves "
                       f"'{state.model_id}')", param="model", code="model_not_found",
                       kind="not_found_error")
    if not ids:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    limits = state.service.snapshot.limits
    spec = body.speculative_config or SpeculativeConfig()
    temperature = 1.0 if body.temperature is None else body.temperature
    penalties = Penalties(body.presence_penalty or 0.0, body.frequency_penalty or 0.0,
                          body.repetition_penalty or 1.0, body.bias())
    top = body.top_logprobs_count()
    out = []
    for i in range(body.n or 1):
        seed = None if body.seed is None else body.seed + i
        sampling = SamplingParams(temperature, body.top_p or 1.0, body.top_k or 0, seed,
                                  body.min_p or 0.0)
        out.append(GenerationRequest(
            tuple(ids), body.limit() or max(1, limits.max_seq_len - len(ids)), sampling,
            body.stops(), speculative=body.speculative_decoding, max_window=spec.max_window,
            tenant=tenant, draft_model=draft_role(spec.draft_model, limits)
            if spec.draft_model is not None else None, method=spec.method, grammar=grammar,
            cache_prompt=body.cache_prompt, penalties=penalties, logprobs=top,
            echo=bool(getattr(body, "echo", False))))
    return out


async def _grammar(state: ServerState, body: GenerationParams) -> str | None:
    """response_format as a grammar, checked against the bundle's tokenizer (off the event
    loop: a large schema takes a while); a 400 naming the construct it cannot compile."""
    try:
        grammar = response_format_grammar(body.response_format)
        param = _schema_param(body)
        if (tools := tool_calls.grammar(body)) is not None:
            if grammar is not None:
                raise RequestError("response_format and tools cannot be combined in one "
                                   "request", param="response_format")
            grammar, param = tools, "tools"
        if grammar is None:
            return None
        if state.grammars is None:
            raise RequestError(f"{param} needs a bundle with a tokenizer (dsc compile "
                               "--tokenizer)", param=param)
        await asyncio.to_thread(state.grammars.check, grammar, param)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None
    return grammar


def _schema_param(body: GenerationParams) -> str:
    return ("response_format.json_schema.schema" if body.response_format
            and body.response_format.get("type") == "json_schema" else "response_format")


@dataclass
class Reply:
    """What a response needs besides its choices."""

    state: ServerState
    kind: str  # "chat" or "text"
    meta: dict  # id, created, model
    tools: list[dict] | None

    @property
    def decode(self):
        tok = self.state.tokenizer
        return tok.decode if tok else (lambda t: "")

    def prompt_text(self, seq: Sequence) -> str:
        return self.decode(list(seq.request.prompt_ids))


def whole(reply: Reply, seqs: list[Sequence]) -> dict:
    """The non-streamed response."""
    out = []
    for i, seq in enumerate(seqs):
        text = TextStream(reply.decode, ()).delta(seq.generated, True, seq.text_end)
        if reply.kind == "chat":
            message, finish = tool_calls.answer(text, seq.finish_reason, reply.tools)
            choice = {"index": i, "message": message, "finish_reason": finish,
                      "logprobs": _chat_logprobs(reply, seq, text)}
        else:
            prefix = reply.prompt_text(seq) if seq.request.echo else ""
            choice = {"index": i, "text": prefix + text, "finish_reason": seq.finish_reason,
                      "logprobs": _completion_logprobs(reply, seq, text)}
        out.append(choice)
    obj = "chat.completion" if reply.kind == "chat" else "text_completion"
    return {**reply.meta, "object": obj, "choices": out, "usage": choices.usage(seqs),
            "speculative_decoding_stats": seqs[0].stats.summary()}


def _chat_logprobs(reply: Reply, seq: Sequence, text: str) -> dict | None:
    if seq.request.logprobs is None or reply.state.tokenizer is None:
        return None
    kept = choices.kept_tokens(seq, reply.decode, text)
    return choices.chat_logprobs(reply.state.tokenizer, seq.logprobs[:kept])


def _completion_logprobs(reply: Reply, seq: Sequence, text: str) -> dict | None:
    if seq.request.logprobs is None or reply.state.tokenizer is None:
        return None
    kept = choices.kept_tokens(seq, reply.decode, text)
    tokens, entries = seq.generated[:kept], seq.logprobs[:kept]
    if seq.request.echo:
        tokens, entries = list(seq.request.prompt_ids) + tokens, seq.prompt_logprobs + entries
    return choices.completion_logprobs(reply.state.tokenizer, entries, tokens)


async def generate(state: ServerState, body, ids: list[int], kind: str, request: Request,
                   prompt_param: str, tools: list[dict] | None = None):
    """Submit the request's choices and answer: whole, or streamed."""
    tenant = request.headers.get("x-tenant-id") or "default"
    endpoint = "chat" if kind == "chat" else "completions"
    if state.draining:
        state.metrics.request(endpoint, "rejected")
        raise APIError(503, "the server is shutting down (draining the requests in flight); "
                       "retry on another replica", kind="service_unavailable_error",
                       code="shutting_down", headers={"Retry-After": "1"})
    try:
        grammar = await _grammar(state, body)
        handle = await state.service.submit(
            requests_of(state, body, ids, tenant, prompt_param, grammar),
            retry_count(request.headers.get(RETRY_HEADER)))
        admitted = await waiting.admitted(state.service, handle, request)
    except RequestError as e:  # named as the client sent it (messages, not prompt)
        state.metrics.request(endpoint, "rejected")
        param = prompt_param if e.param == "prompt" else e.param
        raise APIError(400, str(e), param=param, code=e.code) from None
    except asyncio.CancelledError:
        state.metrics.request(endpoint, "cancelled")
        raise
    except Exception:
        state.metrics.request(endpoint, "rejected")
        raise
    if not admitted:
        state.metrics.request(endpoint, "cancelled")
        return Response(status_code=499)
    reply = Reply(state, kind, {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()), "model": state.model_id}, tools)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(reply, handle, include_usage, endpoint),
                                 media_type="text/event-stream")
    try:
        seqs = await waiting.finished(state.service, handle, request)
    except asyncio.CancelledError:
        state.metrics.request(endpoint, "cancelled")
        raise
    if seqs is None:
        state.metrics.request(endpoint, "cancelled")
        return Response(status_code=499)
    state.metrics.request(endpoint, "ok")
    return whole(reply, seqs)


class ChoiceStream:
    """One choice's stream: its text so far, its tool calls, its logprobs sent."""

    def __init__(self, reply: Reply, seq: Sequence, index: int):
        self.reply, self.seq, self.index = reply, seq, index
        self.text = TextStream(reply.decode, seq.request.stop)
        self.calls = tool_calls.CallStream(reply.tools)
        self.sent_logprobs = 0
        self.echo = reply.kind == "text" and seq.request.echo  # the prompt first, once scored

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False,
              call: dict | None = None, logprobs: dict | None = None) -> dict:
        if self.reply.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            if call is not None:
                delta = {"tool_calls": [call]}
            return {"index": self.index, "delta": delta, "finish_reason": finish,
                    "logprobs": logprobs}
        return {"index": self.index, "text": text or "", "finish_reason": finish,
                "logprobs": logprobs}

    def new_logprobs(self, count: int) -> dict | None:
        """Logprobs of the tokens up to `count` not sent yet."""
        seq, tok = self.seq, self.reply.state.tokenizer
        if seq.request.logprobs is None or tok is None:
            return None
        entries = seq.logprobs[self.sent_logprobs:count]
        tokens = seq.generated[self.sent_logprobs:count]
        self.sent_logprobs = max(self.sent_logprobs, count)
        if self.reply.kind == "chat":
            return choices.chat_logprobs(tok, entries)
        return choices.completion_logprobs(tok, entries, tokens)

    def step(self, count: int, finish: str | None) -> list[dict]:
        """The chunks of one event: the choice has `count` tokens, done when `finish`."""
        seq = self.seq
        text = self.calls.text(self.text.delta(seq.generated[:count], finish is not None,
                                               seq.text_end if finish else None))
        out = []
        if self.echo:
            self.echo = False
            out.append(self.chunk(self.reply.prompt_text(seq), logprobs=_echo(self.reply, seq)))
        logprobs = self.new_logprobs(count)
        if text or logprobs:
            out.append(self.chunk(text, logprobs=logprobs))
        if finish is None:
            out += [self.chunk(None, call=call) for call in self.calls.deltas()]
            return out
        last, rest, called = self.calls.finish()
        if rest:
            out.append(self.chunk(rest))
        out += [self.chunk(None, call=call) for call in last]
        out.append(self.chunk(None, "tool_calls" if called else finish))
        return out


async def _sse(reply: Reply, handle: Handle, include_usage: bool, endpoint: str):
    state = reply.state
    obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
    usage_field = {"usage": None} if include_usage else {}
    streams = [ChoiceStream(reply, seq, i) for i, seq in enumerate(handle.seqs)]

    def event(parts: list[dict], extra: dict | None = None) -> str:
        payload = {**reply.meta, "object": obj, "choices": parts, **usage_field, **(extra or {})}
        return f"data: {json.dumps(payload)}\n\n"

    left, done = set(range(len(streams))), False
    try:
        if reply.kind == "chat":
            yield event([s.chunk(None, role=True) for s in streams])
        while left:
            item = await handle.events.get()
            if item[0] == "error":
                e = errors.server_error(item[1])
                body = errors.error_body(e.message, e.kind, e.param, e.code)
                yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
                state.metrics.request(endpoint, "error")
                return
            _, index, count, finish = item
            parts = streams[index].step(count, finish)
            if finish is not None:
                left.discard(index)
            for part in parts:
                last = part.get("finish_reason") is not None
                yield event([part], {"speculative_decoding_stats":
                                     streams[index].seq.stats.summary()} if last else None)
        if include_usage:
            yield event([], {"usage": choices.usage(handle.seqs)})
        yield "data: [DONE]\n\n"
        done = True
        state.metrics.request(endpoint, "ok")
    finally:
        if not done:  # the client went away mid-stream: stop and free its KV blocks
            state.service.cancel(handle)
            state.metrics.request(endpoint, "cancelled")


def _echo(reply: Reply, seq: Sequence) -> dict | None:
    if seq.request.logprobs is None or reply.state.tokenizer is None:
        return None
    return choices.completion_logprobs(reply.state.tokenizer, seq.prompt_logprobs,
                                       list(seq.request.prompt_ids))
