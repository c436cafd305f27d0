"""Errors a user can act on. The CLIs print their message and exit 2; nothing else is shown."""

from __future__ import annotations


class DSparkError(Exception):
    """A clear, one-line problem with the user's input (file, flag, config, request)."""

    exit_code = 2


class BundleError(DSparkError):
    """A bundle is missing, tampered, truncated or of another format version."""


class ModelInputError(DSparkError):
    """An input ONNX model does not meet the compiler's contract."""


class UnmappableAttentionError(ModelInputError):
    """An attention subgraph the compiler cannot turn into SpeculativeVerify."""


class ConflictError(DSparkError):
    """The request conflicts with the server's current state (e.g. a running sequence)."""


class QueueFullError(DSparkError):
    """Too many requests are waiting; try again in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestError(DSparkError):
    """A generation request the engine cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
