"""Exceptions the engine raises; the HTTP edge maps them to OpenAI error objects."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot serve as given (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelLoadError(EngineError):
    """The model could not be found or is not supported."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full, or would make a new request wait longer than the replica's
    bound (maps to HTTP 503 with Retry-After: retry_after_s when set, else the server's)."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine loop stopped after an internal failure."""
