"""Reading a request body within the size cap, and typed access to its JSON fields with errors that name them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import orjson

from sidecar.gateway import ENCODINGS
from sidecar.http.errors import HttpError
from sidecar.scheduler import Lane

# A JSON body larger than this is refused (413) before it is read whole; bulk goes over gRPC.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
LANE_HEADER = "x-fern-lane"
_LANES = {"online": Lane.ONLINE, "batch": Lane.BATCH}


def _too_big(size: int | str, cap: int) -> HttpError:
    return HttpError(413, f"request body: {size} bytes exceeds this door's limit of {cap} bytes "
                          "(fern serve --http-max-body-bytes); send bulk work over gRPC "
                          "(EmbedStream, FernClient.embed_stream), which streams with flow control",
                     code="body_too_large")


async def read_json(content_length: str | None, chunks: AsyncIterator[bytes], cap: int) -> object:
    """The parsed JSON body: refused by its Content-Length, or while streaming, once past `cap`."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise HttpError(400, f"Content-Length: {content_length!r} is not a number") from None
        if declared > cap:
            raise _too_big(declared, cap)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise _too_big(f"more than {cap}", cap)
        parts.append(chunk)
    body = b"".join(parts)
    if not body.strip():
        raise HttpError(400, "request body: empty; send a JSON object", error_type="empty")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise HttpError(400, f"request body: not valid JSON ({error})", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise HttpError(400, f"request body: expected a JSON object, got {kind(payload)}", code="invalid_json")
    return payload


def kind(value: object) -> str:
    """JSON's name for a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong(name: str, expected: str, value: object, param: str | None = None) -> HttpError:
    return HttpError(400, f"{name}: expected {expected}, got {kind(value)}", param=param or name,
                     code="invalid_type")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(texts: Sequence) -> bool:
    """Whether `texts` is a list of token ids, or a list of lists of them (OpenAI's other inputs)."""
    if all(_is_id(t) for t in texts):
        return True
    return all(isinstance(t, list) and t and all(_is_id(i) for i in t) for t in texts)


def get_str(payload: dict, name: str, default: str = "") -> str:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def get_bool(payload: dict, name: str, default: bool | None) -> bool | None:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(name, "true or false", value)
    return value


def get_dimensions(payload: dict) -> int:
    """`dimensions` (Matryoshka truncation): a positive integer, or absent for the full size (0)."""
    value = payload.get("dimensions")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong("dimensions", "a positive integer", value)
    if value < 1:
        raise HttpError(400, f"dimensions: {value} is not a positive integer (leave it out for the full size)",
                        param="dimensions", code="invalid_value")
    return value


def get_lane(payload: dict, header: str | None) -> Lane:
    """`lane` from the body, else the X-Fern-Lane header, else ONLINE."""
    value = payload.get("lane")
    source = "lane"
    if value is None:
        value, source = header, "X-Fern-Lane"
    if value is None:
        return Lane.ONLINE
    lane = _LANES.get(value.lower()) if isinstance(value, str) else None
    if lane is None:
        raise HttpError(400, f"{source}: {value!r} is not a lane (online or batch)", param="lane",
                        code="invalid_value")
    return lane


def get_encoding(payload: dict) -> str:
    """Fern's `encoding`: float32 (default), float16, int8 or binary (packed bits)."""
    value = get_str(payload, "encoding", "float32")
    if value not in ENCODINGS:
        raise HttpError(400, f"encoding: {value!r} is not one of {', '.join(ENCODINGS)}", param="encoding",
                        code="invalid_value")
    return value


def get_texts(payload: dict, field: str, max_inputs: int, token_refusal: Callable[[], HttpError]) -> list[str]:
    """`field` as a list of texts: a string or a list of strings; token ids get `token_refusal()`.

    Refused here, naming the input: a wrong type, an empty list, more inputs than one call may
    carry (413: bulk belongs on gRPC's EmbedStream), a NUL character. Empty texts and what
    the model cannot take are the gateway's to refuse, with the gateway's messages.
    """
    value = payload.get(field)
    if isinstance(value, str):
        texts: Sequence = [value]
    elif isinstance(value, list):
        if not value:
            raise HttpError(400, f"{field}: an empty list; send at least one text", param=field,
                            code="empty_input", error_type="empty")
        texts = value
    elif value is None:
        raise HttpError(400, f"{field}: missing; send a string or a list of strings", param=field,
                        code="missing_input", error_type="empty")
    else:
        raise _wrong(field, "a string or a list of strings", value)
    if len(texts) > max_inputs:
        raise HttpError(413, f"{field}: {len(texts)} inputs exceeds the limit of {max_inputs} per request "
                             "(fern serve --max-request-inputs); split it, or send bulk work over gRPC "
                             "(EmbedStream, FernClient.embed_stream)", param=field, code="too_many_inputs")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            if _token_ids(texts):
                raise token_refusal()
            raise _wrong(f"{field}[{i}]", "a string", text, param=field)
        if "\x00" in text:
            raise HttpError(400, f"{field}[{i}]: contains a NUL character (U+0000) at position "
                                 f"{text.index(chr(0))}; a NUL is not text (binary data, or a C string?)",
                            param=field, code="invalid_value")
    return list(texts)
