"""Bearer-token authentication as a pure ASGI middleware.

Not Starlette's `@app.middleware("http")`: that wraps the app's receive channel, and a
handler behind it never sees `http.disconnect`, so a non-streaming request whose client
went away would run to its max_tokens instead of being cancelled.
"""

from __future__ import annotations

import hmac

from dspark.runtime.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class BearerAuth:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if (self.expected is None or scope["type"] != "http"
                or scope.get("path") in OPEN_PATHS):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                code="invalid_api_key").response()
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
