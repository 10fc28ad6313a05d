"""HTTP refusals: an EmbedError (or a bad HTTP request) as OpenAI's or TEI's error envelope and status."""

from __future__ import annotations

import re

import grpc

from sidecar.errors import EmbedError

# Seconds a client is told to wait after a full queue (OpenAI's SDK honours Retry-After).
RETRY_AFTER_S = 1
# The gateway names an input the way the gRPC request spells it; over HTTP it is `input` / `inputs`.
_FIELD = re.compile(r"^(texts|token_ids)(\[\d+\])")
_PARAM = re.compile(r"^([a-z_]+)(?:\[\d+\])?:")


class HttpError(Exception):
    """A request the HTTP door refuses: an HTTP status and a message that names the input.

    `param` is OpenAI's (the offending field), `code` a short machine-readable reason,
    `error_type` TEI's (validation, empty, overloaded, unhealthy, backend, tokenizer).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str = "validation", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"HttpError({self.status}, {self.message!r}, param={self.param!r})"

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"retry-after": str(self.retry_after)}

    def openai_body(self) -> dict:
        """OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def tei_body(self) -> dict:
        """TEI's envelope: {"error", "error_type"}."""
        return {"error": self.message, "error_type": self.error_type}


def renamed(message: str, field: str) -> str:
    """`texts[3]: empty text` as the HTTP field is called: `input[3]: empty text` (and the
    truncation option as the HTTP body spells it)."""
    message = message.replace("(truncation is TRUNCATION_ERROR)", "(truncate is false: true cuts it at the end)")
    return _FIELD.sub(lambda m: field + m.group(2), message, count=1)


def from_embed_error(error: EmbedError, field: str) -> HttpError:
    """The HTTP status for a gateway refusal; `field` is what the API calls its inputs."""
    message = renamed(error.message, field)
    code = error.code
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _PARAM.match(message)
        param = match.group(1) if match else None
        if param == "request":
            param = field
        too_long = "exceeds the model's limit" in message or "so it never fits" in message
        return HttpError(413 if too_long else 400, message, param=param,
                         code="input_too_long" if too_long else "invalid_value",
                         error_type="empty" if message.endswith("empty text") else "validation")
    if code == grpc.StatusCode.NOT_FOUND:
        return HttpError(404, message, param="model", code="model_not_found")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return HttpError(429, message, code="queue_full", error_type="overloaded", retry_after=RETRY_AFTER_S)
    if code == grpc.StatusCode.UNAVAILABLE:
        return HttpError(503, message, code="draining", error_type="unhealthy")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HttpError(504, message, code="deadline_exceeded", error_type="backend")
    return HttpError(500, message, code="internal", error_type="backend")


def tei_status(error: HttpError) -> int:
    """TEI's status for a refusal: 413 for size, 422 for other validation, 400 for empty input."""
    if error.status == 400:
        return 400 if error.error_type == "empty" else 422
    return error.status
