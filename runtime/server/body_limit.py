"""Request bodies above a size limit get a 413 before any of them is parsed.

A pure ASGI middleware: it reads the body (Content-Length or chunked) up to the limit,
answers 413 in OpenAI's error shape past it, and otherwise replays what it read to the app,
then hands over the connection's own receive (the app still sees a client disconnect).
"""

from __future__ import annotations

import json


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send) -> None:
        body = json.dumps({"error": {
            "message": f"request body larger than the server's limit of {self.max_bytes} bytes "
                       "(dsrun --max-body-mb)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
