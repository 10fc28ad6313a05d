"""Errors a caller can cause, carried as a gRPC status code plus a message that names the input."""

from __future__ import annotations

import grpc

# Trailing-metadata key on a failed unary call; the value is the offending input's index.
INPUT_INDEX_KEY = "fern-input-index"


class EmbedError(Exception):
    """A request the sidecar refuses or could not finish.

    `code` is the gRPC status the server returns; `message` names the offending input
    (``texts[3]: empty text``) when there is one, and `index` is that input's position in
    the request (None when the error is about the request as a whole).
    """

    def __init__(self, code: grpc.StatusCode, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.index = index

    def __repr__(self) -> str:
        return f"EmbedError({self.code.name}, {self.message!r}, index={self.index})"


def invalid_argument(message: str, index: int | None = None) -> EmbedError:
    """An input the request should not have carried (INVALID_ARGUMENT)."""
    return EmbedError(grpc.StatusCode.INVALID_ARGUMENT, message, index)


def not_found(message: str) -> EmbedError:
    """A model name this sidecar does not serve (NOT_FOUND)."""
    return EmbedError(grpc.StatusCode.NOT_FOUND, message)


def resource_exhausted(message: str) -> EmbedError:
    """The lane's queue is full: retry later (RESOURCE_EXHAUSTED)."""
    return EmbedError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> EmbedError:
    """The sidecar is draining for shutdown (UNAVAILABLE)."""
    return EmbedError(grpc.StatusCode.UNAVAILABLE, message)


def deadline_exceeded(message: str) -> EmbedError:
    """The caller's deadline passed before the work reached the GPU (DEADLINE_EXCEEDED)."""
    return EmbedError(grpc.StatusCode.DEADLINE_EXCEEDED, message)
