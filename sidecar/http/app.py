"""The HTTP door's ASGI app: OpenAI and TEI routes over the one Gateway, with auth, body caps and drain.

Every route but `GET /health` needs the sidecar's token as `Authorization: Bearer …`, checked
before the body is read. A body is refused (413) by its Content-Length, or while it streams
in, once past the cap. Errors come in the route's own envelope: OpenAI's under `/v1/…` and
`/embeddings`, TEI's elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core_engine.config import ModelSpec
from sidecar.errors import EmbedError
from sidecar.gateway import DRAINING, GENERIC_PROMPTS, EmbedParams, EmbedResult, Gateway
from sidecar.http import openai_api, rerank_api, tei_api
from sidecar.http.body import DEFAULT_MAX_BODY_BYTES, LANE_HEADER, read_json
from sidecar.http.errors import HttpError, from_embed_error, tei_status
from sidecar.lanes import Lane
from sidecar.security import AuthLimiter

log = logging.getLogger(__name__)

Authorizer = Callable[[str | None], bool]
# BATCH requests, and ONLINE ones of this many inputs or more, are cancelled in the scheduler when
# their client disconnects, so the engine does not embed what nobody will read.
WATCHED_INPUTS = 16
_JSON = "application/json"
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def bearer_checker(token: str) -> Authorizer:
    """`authorized(header)` for one shared token: `Authorization: Bearer <token>`, compared in constant time."""
    expected = f"Bearer {token}".encode()

    def authorized(header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), expected)

    return authorized


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body, option=_NUMPY), status_code=status, headers=headers, media_type=_JSON)


class HttpApp:
    """`HttpApp(gateway)` is an ASGI app; `begin_drain()` turns new requests away with 503.

    `authorized(header)` decides on the Authorization header (None: no auth); a wrong token
    waits out the failed-auth `limiter`'s back-off for its address, before the body is read;
    `observe(route, status, lane, seconds)` is told of every answered request (the metrics).
    """

    def __init__(self, gateway: Gateway, *, authorized: Authorizer | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 observe: Callable[[str, int, str, float], None] | None = None,
                 limiter: AuthLimiter | None = None) -> None:
        self.gateway = gateway
        self.authorized = authorized
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.observe = observe
        self.draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tokenizers = tei_api.Tokenizers()
        openai, tei = "openai", "tei"
        routes = [
            self._route("/v1/embeddings", "POST", openai, self._openai_embeddings),
            self._route("/embeddings", "POST", openai, self._openai_embeddings),
            self._route("/v1/models", "GET", openai, self._openai_models),
            self._route("/v1/models/{model:path}", "GET", openai, self._openai_model),
            self._route("/embed", "POST", tei, self._tei_embed),
            self._route("/", "POST", tei, self._tei_embed),
            self._route("/embed_sparse", "POST", tei, self._tei_embed_sparse),
            self._route("/tokenize", "POST", tei, self._tei_tokenize),
            self._route("/info", "GET", tei, self._tei_info),
            self._route("/health", "GET", tei, self._health, auth=False),
            self._route("/rerank", "POST", tei, self._tei_rerank),
            self._route("/v1/rerank", "POST", "cohere", self._cohere_rerank),
            self._route("/v2/rerank", "POST", "cohere", self._cohere_rerank),
        ]
        self._app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})
        # Exact paths skip Starlette's middleware stack and route matching (their endpoints catch
        # everything themselves); templated paths, unknown paths and methods go through Starlette.
        self._exact = {(method, route.path): route.endpoint for route in routes if "{" not in route.path
                       for method in route.methods if method != "HEAD"}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            endpoint = self._exact.get((scope["method"], scope["path"]))
            if endpoint is not None:
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)

    @property
    def in_flight(self) -> int:
        """Requests being answered now."""
        return self._active

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for requests in flight to be answered; False when `timeout` passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ plumbing

    def _route(self, path: str, method: str, flavor: str, handler: Callable[[Request], Awaitable[Response]],
               *, auth: bool = True) -> Route:
        field = openai_api.FIELD if flavor == "openai" else tei_api.FIELD

        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            self._active += 1
            self._idle.clear()
            lane = "online"
            try:
                if self.draining or self.gateway.draining:
                    raise HttpError(503, DRAINING, code="draining", error_type="unhealthy")
                if auth and self.authorized is not None and not self.authorized(request.headers.get("authorization")):
                    refused = None
                    if self.limiter is not None and request.client is not None:
                        refused = await self.limiter.penalize(request.client.host)
                    raise HttpError(401, "missing or wrong token: send 'Authorization: Bearer <token>' "
                                         "(the sidecar's --token)" + (f"; {refused}" if refused else ""),
                                    code="invalid_api_key", error_type="unauthorized")
                response = await handler(request)
                lane = request.scope.get("fern.lane", lane)
            except HttpError as error:
                response = self._error(flavor, error)
                lane = request.scope.get("fern.lane", lane)
            except EmbedError as error:
                response = self._error(flavor, from_embed_error(error, field))
                lane = request.scope.get("fern.lane", lane)
            except Exception as error:  # our bug: say so, keep serving
                log.exception("internal error on %s %s", method, path)
                response = self._error(flavor, HttpError(500, f"internal error: {type(error).__name__}: {error}",
                                                         code="internal", error_type="backend"))
            finally:
                self._active -= 1
                if self._active == 0:
                    self._idle.set()
            if self.observe is not None:
                self.observe(path, response.status_code, lane, time.perf_counter() - started)
            return response

        return Route(path, endpoint, methods=[method], name=path)

    @staticmethod
    def _error(flavor: str, error: HttpError) -> Response:
        headers = error.headers
        if error.status == 401:
            headers = {**headers, "www-authenticate": "Bearer"}
        if flavor == "openai":
            return json_response(error.openai_body(), error.status, headers)
        if flavor == "cohere":  # Cohere's envelope: {"message"}
            return json_response({"message": error.message}, error.status, headers)
        return json_response(error.tei_body(), tei_status(error), headers)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Unknown paths and methods, in the envelope of the API the path belongs to."""
        path = request.url.path
        flavor = "openai" if path.startswith(("/v1/", "/embeddings")) else "tei"
        message = (f"{request.method} {path}: no such route (OpenAI: POST /v1/embeddings, GET /v1/models; "
                   "TEI: POST /embed, /embed_sparse, /tokenize, GET /info, /health)") if exc.status_code == 404 \
            else f"{request.method} {path}: {exc.detail}"
        response = self._error(flavor, HttpError(exc.status_code, message, code="not_found"))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def _payload(self, request: Request) -> dict:
        return await read_json(request.headers.get("content-length"), request.stream(), self.max_body_bytes)

    async def _embed(self, request: Request, params: EmbedParams) -> EmbedResult:
        request.scope["fern.lane"] = params.lane.name.lower()
        if params.lane is Lane.ONLINE and len(params.texts) + len(params.token_ids) < WATCHED_INPUTS:
            return await self.gateway.embed(params)  # a query: done before a disconnect would matter
        work = asyncio.ensure_future(self.gateway.embed(params))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client went away (or this handler was cancelled): so does its work
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise HttpError(499, "the client closed the connection before the answer",
                            code="client_closed", error_type="client_closed")
        return work.result()

    # ------------------------------------------------------------------ OpenAI

    async def _openai_embeddings(self, request: Request) -> Response:
        payload = await self._payload(request)
        params, encoding_format = openai_api.parse(payload, request.headers.get(LANE_HEADER),
                                                   self.gateway.default_model, self.gateway.max_inputs)
        result = await self._embed(request, params)
        return json_response(openai_api.response(result, encoding_format))

    async def _openai_models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [openai_api.model_entry(s) for s in self.gateway.models()]})

    async def _openai_model(self, request: Request) -> Response:
        spec = self.gateway.registry.get(request.path_params["model"]).spec
        return json_response(openai_api.model_entry(spec))

    # ------------------------------------------------------------------ TEI

    async def _tei_embed(self, request: Request) -> Response:
        payload = await self._payload(request)
        params = tei_api.parse_embed(payload, request.headers.get(LANE_HEADER), self.gateway.max_inputs)
        return json_response(tei_api.embed_response(await self._embed(request, params)))

    async def _tei_embed_sparse(self, request: Request) -> Response:
        payload = await self._payload(request)
        params = tei_api.parse_embed(payload, request.headers.get(LANE_HEADER), self.gateway.max_inputs, sparse=True)
        return json_response(tei_api.sparse_response(await self._embed(request, params)))

    async def _tei_tokenize(self, request: Request) -> Response:
        payload = await self._payload(request)
        model, texts, special, prompt_name = tei_api.parse_tokenize(payload, self.gateway.max_inputs)
        spec = self.gateway.registry.get(model).spec
        prompt = self._prompt(spec, prompt_name)
        return json_response(await self._tokenizers.tokenize(spec, [prompt + t for t in texts], special))

    @staticmethod
    def _prompt(spec: ModelSpec, name: str) -> str:
        """The prompt text the gateway prepends for `name` ("" = the model's default prompt)."""
        if not name:
            return spec.prompts.get(spec.default_prompt_name, "") if spec.default_prompt_name else ""
        if name in spec.prompts:
            return spec.prompts[name]
        if name in GENERIC_PROMPTS:
            return ""
        known = ", ".join(sorted({*spec.prompts, *GENERIC_PROMPTS}))
        raise HttpError(422, f"prompt_name: {name!r} is not a prompt of model {spec.name!r} (known: {known})",
                        param="prompt_name")

    async def _tei_info(self, request: Request) -> Response:
        served = self.gateway.registry.get("")
        body = tei_api.info(served.spec, self.gateway.max_inputs, served.scheduler.config.max_step_tokens)
        if served.engines:
            body["model_dtype"] = str(served.engines[0].dtype).removeprefix("torch.")
        return json_response(body)

    async def _health(self, request: Request) -> Response:
        return Response(b"", status_code=200)

    # ------------------------------------------------------------------ reranking

    async def _tei_rerank(self, request: Request) -> Response:
        payload = await self._payload(request)
        params = rerank_api.parse_tei(payload, request.headers.get(LANE_HEADER), self.gateway.max_documents)
        request.scope["fern.lane"] = params.lane.name.lower()
        return json_response(rerank_api.tei_response(await self.gateway.rerank(params)))

    async def _cohere_rerank(self, request: Request) -> Response:
        payload = await self._payload(request)
        params = rerank_api.parse_cohere(payload, request.headers.get(LANE_HEADER), self.gateway.max_documents)
        request.scope["fern.lane"] = params.lane.name.lower()
        version = "2" if request.url.path.startswith("/v2/") else "1"
        return json_response(rerank_api.cohere_response(await self.gateway.rerank(params), version))


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: what receive() gives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
