"""Errors that reach users as one clear line (the programs print them and exit with status 1)."""
from __future__ import annotations

from typing import Any


class PyllamaError(Exception):
    """Base class of every error pyllama reports to a user without a traceback."""


class ModelFileError(PyllamaError):
    """A model file that is missing, corrupt, truncated or of an unsupported kind."""


class ContextLimitError(PyllamaError):
    """A request that does not fit the context it was given."""


class UnsupportedOpError(PyllamaError):
    """A placement that gives layers to a device without the ops they need."""


class HTTPError(Exception):
    """A request refused with an HTTP status and an llama-server style error body (raised by the
    handlers, Request.json, and the layers below them that judge a request, e.g. a grammar)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.extra = extra  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx, ...)
