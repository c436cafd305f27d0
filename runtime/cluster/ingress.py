"""The cluster's HTTP front, a Ray Serve ingress deployment: every route is relayed to an
engine replica (chosen by router.TenantAffinityRouter from the request's routing key),
except /metrics, which renders every replica's metrics from the ClusterBoard.

A replica that dies answers its requests with OpenAI errors, never a bare 500 page: before
it sent anything the request is retried once on another replica (nothing reached the
client, and generation has no side effects), else a 503 `replica_unavailable`; a stream
already under way ends with an error event and `[DONE]`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from dspark.runtime.cluster.board import board_handle
from dspark.runtime.cluster.forward import Forwarded, Head
from dspark.runtime.cluster.routing import route_key
from dspark.runtime.cluster.spec import ClusterSpec
from dspark.runtime.server import errors
from dspark.runtime.server.auth import BearerAuth
from dspark.runtime.server.body_limit import BodyLimit
from dspark.runtime.server.errors import APIError

log = logging.getLogger("dspark.cluster")
REPLICA_GONE = (RayActorError, ActorUnavailableError)
ATTEMPTS = 2  # a request whose replica died before answering is tried once more
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class Ingress:
    async def __init__(self, engine, spec: ClusterSpec) -> None:
        self.engine = engine.options(stream=True)
        self.spec = spec
        self.board = board_handle(serve.get_replica_context().app_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return ingress_app(self.engine, self.board, self.spec)


def ingress_app(engine, board, spec: ClusterSpec) -> FastAPI:
    app = FastAPI(title="DSpark cluster", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=spec.max_body_bytes)
    app.add_middleware(BearerAuth, api_key=spec.api_key)

    @app.get("/metrics")
    async def metrics():
        return Response(await board.render.remote(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=METHODS)
    async def relay(path: str, request: Request):
        body = await request.body()
        headers = tuple((k.lower(), v) for k, v in request.scope["headers"])
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        fwd = Forwarded(request.method, request.url.path, request.scope["query_string"],
                        headers, body, route_key(named, body))
        return await _relay(engine, fwd)

    return app


async def _relay(engine, fwd: Forwarded):
    for attempt in range(1, ATTEMPTS + 1):
        stream = engine.handle.remote(fwd)
        try:
            head = await stream.__anext__()
        except REPLICA_GONE as e:
            log.warning("replica failed before answering (attempt %d): %s", attempt, e)
            if attempt < ATTEMPTS:
                continue
            raise _unavailable() from None
        except BackPressureError:
            raise APIError(429, "every replica's queue is full; retry shortly",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except StopAsyncIteration:
            raise errors.server_error(RuntimeError("the replica sent no response")) from None
        response = StreamingResponse(_body(stream, head), status_code=head.status)
        response.raw_headers = [(k, v) for k, v in head.headers if k != b"content-length"]
        return response
    raise _unavailable()


async def _body(stream, head: Head):
    try:
        async for chunk in stream:
            yield chunk
    except REPLICA_GONE as e:
        log.warning("replica failed mid-response: %s", e)
        if head.streaming:
            body = errors.error_body(_unavailable().message, "server_error",
                                     code="replica_unavailable")
            yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        stream.cancel()


def _unavailable() -> APIError:
    return APIError(503, "the replica serving this request stopped; retry (the cluster "
                    "restarts it and routes new requests to the others)",
                    kind="service_unavailable_error", code="replica_unavailable",
                    headers={"Retry-After": "1"})
