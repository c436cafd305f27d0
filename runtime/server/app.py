"""The OpenAI-compatible HTTP API over an EngineService (FastAPI; run by uvicorn).

    GET  /v1/models            POST /v1/completions        POST /v1/chat/completions
    POST /v1/cache/resize      POST /v1/warmup             GET  /health   GET /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from dspark.runtime.bundle.tokenizer import BundleTokenizer
from dspark.runtime.errors import ConflictError
from dspark.runtime.server import errors, tool_calls
from dspark.runtime.server.auth import BearerAuth
from dspark.runtime.server.body_limit import BodyLimit
from dspark.runtime.server.errors import APIError
from dspark.runtime.server.generate import generate
from dspark.runtime.server.protocol import (
    CacheResizeRequest,
    ChatCompletionRequest,
    CompletionRequest,
    WarmupRequest,
)
from dspark.runtime.server.state import ServerState


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
        return await generate(state, body, ids, "chat", request, "messages",
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
        return await generate(state, body, ids, "text", request, "prompt")

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
