"""Embedding a Ray Dataset's text column through running Fern sidecars, from stateless map tasks.

    ds = ds.map_batches(embed_through("gpu-1:50051,gpu-2:50051", column="text"))

Each task opens its own FernClient (one channel, kept for the task's batches); a target
naming several sidecars (a comma list, or dns:///) is balanced by the client's channel. A
batch is sent as requests of `request_texts` texts, `max_in_flight` at a time, through the
BATCH lane. A sidecar whose queue is full (RESOURCE_EXHAUSTED, its flow control) or that is
restarting (UNAVAILABLE) is asked again after a backoff until `timeout` has passed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

import grpc
import numpy as np

from adapters.ray.batches import Batch, located, slices, texts_of, with_vectors
from sidecar.client import EmbedOptions, FernClient, FernError

# Statuses that mean "not now" rather than "never": a full queue, a sidecar restarting or draining.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
_BACKOFF_S = (0.05, 1.0)  # first and longest pause between attempts


class SidecarEmbedder:
    """A `map_batches` callable that adds `output_column` (float32 vectors) from `column`'s texts.

    As an instance it runs in Ray tasks; as a class (`ds.map_batches(SidecarEmbedder,
    fn_constructor_kwargs={...}, concurrency=N)`) in a pool of N actors, each with one
    client. `model` is a served model name ("" = the sidecar's default), `prompt` a prompt
    name ("passage", "document", or one the model defines), `token` None reads FERN_TOKEN in
    the worker; `client_options` are further FernClient arguments (tls_ca=..., ...).
    """

    def __init__(self, target: str, *, column: str = "text", output_column: str = "embedding",
                 model: str = "", lane: str = "batch", prompt: str | None = None,
                 normalize: bool | None = None, truncate: bool = True, dimensions: int = 0,
                 token: str | None = None, request_texts: int = 512, max_in_flight: int = 4,
                 timeout: float = 300.0, **client_options: Any) -> None:
        if request_texts < 1 or max_in_flight < 1:
            raise ValueError(f"request_texts and max_in_flight must be >= 1, "
                             f"got {request_texts} and {max_in_flight}")
        self.target = target
        self.column = column
        self.output_column = output_column
        self.options = EmbedOptions(model=model, lane=lane, prompt=prompt, normalize=normalize,
                                    truncate=truncate, dimensions=dimensions)
        # A bad lane or dimensions fails here, where the pipeline is built; checked on a copy,
        # since the request it caches does not pickle and Ray pickles this object.
        replace(self.options).request()
        self.token = token
        self.request_texts = request_texts
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.client_options = client_options
        self._client: FernClient | None = None
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray ships the callable to its workers; each opens its own channel there.
        return {**self.__dict__, "_client": None, "_pool": None}

    def __call__(self, batch: Batch) -> Batch:
        texts = texts_of(batch, self.column)
        return with_vectors(batch, self.output_column, self.embed(texts))

    def embed(self, texts: list[str]) -> np.ndarray:
        """float32 vectors [len(texts), dims] in input order; BatchError names a refused row."""
        parts = slices(len(texts), self.request_texts)
        if not parts:
            return np.zeros((0, self._dimensions()), dtype=np.float32)
        client, pool = self._open()
        futures = [pool.submit(self._request, client, texts[part], part.start) for part in parts]
        return np.concatenate([f.result() for f in futures])

    def _request(self, client: FernClient, texts: list[str], offset: int) -> np.ndarray:
        deadline = time.monotonic() + self.timeout
        pause = _BACKOFF_S[0]
        while True:
            try:
                return client.embed(texts, timeout=max(0.1, deadline - time.monotonic()),
                                    **asdict(self.options)).vectors
            except FernError as error:
                if error.code in _RETRYABLE and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, _BACKOFF_S[1])
                    continue
                refused = located(error, self.column, offset)
                if refused is not None:
                    raise refused from None
                raise

    def _dimensions(self) -> int:
        if self.options.dimensions:
            return self.options.dimensions
        client, _ = self._open()
        return client.model(self.options.model, timeout=self.timeout).dimensions

    def _open(self) -> tuple[FernClient, ThreadPoolExecutor]:
        if self._client is None:
            self._client = FernClient(self.target, token=self.token, **self.client_options)
            self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="fern-ray")
        return self._client, self._pool

    def close(self) -> None:
        """Close the client's channel and its threads; a later batch opens them again."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._client is not None:
            self._client.close()
        self._client = self._pool = None


def embed_through(target: str, *, column: str = "text", model: str = "", lane: str = "batch",
                  token: str | None = None, **options: Any) -> SidecarEmbedder:
    """The `map_batches` function that embeds `column` through the sidecars at `target`.

        ds.map_batches(embed_through("dns:///fern.svc:50051", column="body", prompt="passage"))

    `options` are SidecarEmbedder's further arguments (output_column, prompt, normalize,
    truncate, dimensions, request_texts, max_in_flight, timeout, FernClient's TLS options).
    """
    return SidecarEmbedder(target, column=column, model=model, lane=lane, token=token, **options)
