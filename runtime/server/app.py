"""The OpenAI-compatible HTTP API over an EngineService (FastAPI; run by uvicorn).

    GET  /v1/models            POST /v1/completions        POST /v1/chat/completions
    POST /v1/cache/resize      POST /v1/warmup             GET  /health   GET /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from dspark.runtime.bundle.tokenizer import BundleTokenizer
from dspark.runtime.errors import ConflictError, RequestError
from dspark.runtime.grammar.constraint import GrammarBook
from dspark.runtime.grammar.formats import response_format_grammar
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.sampling import SamplingParams
from dspark.runtime.sequence.validate import draft_role
from dspark.runtime.server import errors, tool_calls, waiting
from dspark.runtime.server.auth import BearerAuth
from dspark.runtime.server.body_limit import BodyLimit
from dspark.runtime.server.errors import APIError
from dspark.runtime.server.metrics import Metrics
from dspark.runtime.server.protocol import (
    CacheResizeRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    SpeculativeConfig,
    WarmupRequest,
)
from dspark.runtime.server.service import EngineService, Handle
from dspark.runtime.server.streaming import TextStream


@dataclass
class ServerState:
    service: EngineService
    tokenizer: BundleTokenizer | None
    model_id: str
    metrics: Metrics
    api_key: str | None = None
    created: int = 0
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413
    grammars: GrammarBook | None = None  # structured output (None: no tokenizer)
    draining: bool = False  # shutting down: new generation requests get a 503


def create_app(state: ServerState, warmup: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.service.start(warmup)
        yield
        state.service.stop()

    app = FastAPI(title="DSpark", docs_url=None, redoc_url=None, lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(BearerAuth, api_key=state.api_key)  # outermost: runs first

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.service.ready.is_set():
            return JSONResponse({"status": "warming_up"}, status_code=503)
        return {"status": "ok", "model": state.model_id}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        limits = state.service.snapshot.limits
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.created,
            "owned_by": "dspark", "max_model_len": limits.max_seq_len,
            "drafts": list(limits.draft_models)}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        tok = _tokenizer(state)
        messages = tool_calls.chat_messages(body, _text)
        ids = await asyncio.to_thread(tok.encode_chat, messages)
        return await _generate(state, body, ids, "chat", request, "messages",
                               tool_calls.active_tools(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", param="prompt",
                               code="unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(_tokenizer(state).encode, _text(prompt, "prompt"))
        else:
            ids = list(prompt)
        return await _generate(state, body, ids, "text", request, "prompt")

    @app.post("/v1/warmup")
    async def warmup(body: WarmupRequest):
        sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
        result = await state.service.call(lambda e: e.warmup(
            [n for n in sizes if n <= body.main_tokens] or [1],
            [n for n in sizes if n <= body.draft_tokens]))
        other = result.get("other_cores")
        return {"status": "ok", "seconds": round(result["seconds"], 4),
                "main_ms": result["main_ms"],
                "other_cores": None if other is None else round(other, 2)}

    @app.post("/v1/cache/resize")
    async def resize(body: CacheResizeRequest):
        deadline = time.monotonic() + state.service.snapshot.resize_grace_s
        while True:
            try:
                plan = await state.service.call(lambda e: e.resize(body.max_length))
                break
            except ConflictError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        return {"max_length": plan.max_seq_len, "num_blocks": plan.num_blocks,
                "max_seqs": plan.max_seqs, "total_bytes": plan.total_bytes}

    return app


def _text(text: str, param: str) -> str:
    """JSON may carry lone surrogates (\\udcff), which no tokenizer can encode: a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode text ({e.reason} at character "
                       f"{e.start})", param=param, code="invalid_value") from None
    return text


def _tokenizer(state: ServerState) -> BundleTokenizer:
    if state.tokenizer is None:
        raise APIError(400, "the bundle has no tokenizer: send prompt token ids to "
                       "/v1/completions", param="prompt")
    return state.tokenizer


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


def _request(state: ServerState, body: GenerationParams, ids: list[int], tenant: str,
             prompt_param: str, grammar: str | None = None) -> GenerationRequest:
    """The request's shape here; its bounds in validate() (the one path the CLI uses too)."""
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
    sampling = SamplingParams(temperature, body.top_p or 1.0, body.top_k or 0, body.seed)
    request = GenerationRequest(
        tuple(ids), body.limit() or max(1, limits.max_seq_len - len(ids)), sampling,
        body.stops(), speculative=body.speculative_decoding, max_window=spec.max_window,
        tenant=tenant, draft_model=draft_role(spec.draft_model, limits)
        if spec.draft_model is not None else None, method=spec.method, grammar=grammar,
        cache_prompt=body.cache_prompt)
    return request  # validated once, at the engine's door (Engine.submit)


async def _generate(state: ServerState, body, ids: list[int], kind: str, request: Request,
                    prompt_param: str, tools: list[dict] | None = None):
    tenant = request.headers.get("x-tenant-id") or "default"
    endpoint = "chat" if kind == "chat" else "completions"
    if state.draining:
        state.metrics.request(endpoint, "rejected")
        raise APIError(503, "the server is shutting down (draining the requests in flight); "
                       "retry on another replica", kind="service_unavailable_error",
                       code="shutting_down", headers={"Retry-After": "1"})
    try:
        grammar = await _grammar(state, body)
        gen = _request(state, body, ids, tenant, prompt_param, grammar)
        handle = state.service.submit(gen)
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
    meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()), "model": state.model_id}
    decode = state.tokenizer.decode if state.tokenizer else (lambda t: "")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(state, handle, meta, kind, decode, include_usage, endpoint,
                                      tool_calls.CallStream(tools)),
                                 media_type="text/event-stream")
    try:
        seq = await waiting.finished(state.service, handle, request)
    except asyncio.CancelledError:
        state.metrics.request(endpoint, "cancelled")
        raise
    if seq is None:
        state.metrics.request(endpoint, "cancelled")
        return Response(status_code=499)
    state.metrics.request(endpoint, "ok")
    text = TextStream(decode, ()).delta(seq.generated, True, seq.text_end)
    if kind == "chat":
        message, finish = tool_calls.answer(text, seq.finish_reason, tools)
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": seq.finish_reason,
                  "logprobs": None}
    return {**meta, "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": [choice], "usage": _usage(seq),
            "speculative_decoding_stats": seq.stats.summary()}


async def _sse(state: ServerState, handle: Handle, meta: dict, kind: str, decode,
               include_usage: bool, endpoint: str, calls: tool_calls.CallStream):
    stream = TextStream(decode, handle.request.stop)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    usage_field = {"usage": None} if include_usage else {}

    def chunk(text: str | None, finish: str | None = None, role: bool = False,
              extra: dict | None = None, call: dict | None = None) -> str:
        if kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            if call is not None:
                delta = {"tool_calls": [call]}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        payload = {**meta, "object": obj, "choices": [choice], **usage_field, **(extra or {})}
        return f"data: {json.dumps(payload)}\n\n"

    done = False
    try:
        if kind == "chat":
            yield chunk(None, role=True)
        while not done:
            event = await handle.events.get()
            if event[0] == "error":
                e = errors.server_error(event[1])
                body = errors.error_body(e.message, e.kind, e.param, e.code)
                yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
                state.metrics.request(endpoint, "error")
                return
            _, count, finish = event
            seq = handle.seq
            text = calls.text(stream.delta(seq.generated[:count], finish is not None,
                                           seq.text_end if finish else None))
            if text:
                yield chunk(text)
            if finish is None:
                for call in calls.deltas():
                    yield chunk(None, call=call)
            else:
                done = True
                last, rest, called = calls.finish()
                if rest:
                    yield chunk(rest)
                for call in last:
                    yield chunk(None, call=call)
                finish = "tool_calls" if called else finish
                yield chunk(None, finish,
                            extra={"speculative_decoding_stats": seq.stats.summary()})
                if include_usage:
                    usage = {**meta, "object": obj, "choices": [], "usage": _usage(seq)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
                state.metrics.request(endpoint, "ok")
    finally:
        if not done:  # the client went away mid-stream: stop and free its KV blocks
            state.service.cancel(handle)
            state.metrics.request(endpoint, "cancelled")


def _usage(seq: Sequence) -> dict:
    return {"prompt_tokens": seq.prompt_len, "completion_tokens": len(seq.generated),
            "total_tokens": seq.prompt_len + len(seq.generated),
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}
