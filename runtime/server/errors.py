"""OpenAI-style error objects: {"error": {"message", "type", "param", "code"}} with a 4xx,
for every bad input, never a 500 for a user's mistake."""

from __future__ import annotations

import logging
import math
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.runtime.errors import ConflictError, DSparkError, QueueFullError, RequestError

log = logging.getLogger("dspark.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('msg')}",
                        code="invalid_json").response()
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {'.'.join(loc)}",
                        param=".".join(loc), code="unknown_parameter").response()
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {err.get('msg')}", param=where,
                    code="invalid_value").response()


def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), kind=kind).response()


def server_error(error: Exception) -> APIError:
    """A request's failure as the client sees it: a RequestError is its fault (400); anything
    else a 500 carrying an id that the server's log line repeats."""
    if isinstance(error, RequestError):
        return APIError(400, str(error), param=error.param, code=error.code)
    ref = f"err-{uuid.uuid4().hex[:12]}"
    log.error("%s: %s", ref, error, exc_info=error)
    return APIError(500, f"internal error ({ref}); the server keeps serving",
                    kind="server_error", code="internal_error")


def retry_headers(seconds: float) -> dict[str, str]:
    """A 429's wait: Retry-After in whole seconds (HTTP's), and retry-after-ms, which the
    OpenAI SDKs read first, to the millisecond."""
    return {"Retry-After": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(max(1, round(1000 * seconds)))}


def install(app) -> None:
    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(QueueFullError, lambda _, e: APIError(
        429, str(e), code="queue_full", kind="rate_limit_error",
        headers=retry_headers(e.retry_after)).response())
    app.add_exception_handler(ConflictError, lambda _, e: APIError(
        409, str(e), code="conflict").response())
    app.add_exception_handler(RequestError, lambda _, e: APIError(
        400, str(e), param=e.param, code=e.code).response())
    app.add_exception_handler(DSparkError, lambda _, e: APIError(400, str(e)).response())
    app.add_exception_handler(Exception, lambda _, e: server_error(e).response())
