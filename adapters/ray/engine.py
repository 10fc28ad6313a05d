"""Fern's engine inside a Ray actor: `ds.map_batches(FernEmbedder, ..., num_gpus=1)` embeds with no sidecar.

Each actor loads the model the way `fern serve` does (sidecar.registry.Registry.load) and
embeds through the sidecar's own Gateway, so prompts, truncation, normalization and the
scheduler's batching are the sidecar's code, and the vectors are the sidecar's vectors.
The gateway is asynchronous; the actor runs it on an event loop of its own, in a thread,
so `__call__` works whatever thread Ray calls it from.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from adapters.ray.batches import Batch, located, slices, texts_of, with_vectors
from sidecar.errors import EmbedError

if TYPE_CHECKING:
    from core_engine.settings import SidecarConfig


class FernEmbedder:
    """A `map_batches` class: one engine per actor, adding `output_column` from `column`'s texts.

        ds.map_batches(FernEmbedder, fn_constructor_kwargs={"column": "body"},
                       concurrency=4, num_gpus=1, batch_size=4096)

    `model` is what `fern serve --model` takes ("" = the bundled model, `DIR` or `NAME=DIR`);
    `device` "auto" is the GPU Ray gave the actor, else the CPU. `prompt`, `normalize`,
    `truncate` and `dimensions` mean what they mean on the wire. `tokenizer_processes` 0
    tokenizes on threads in the actor (Ray has already counted the actor's CPUs); `settings`
    is the sidecar's SidecarConfig (tokenizer memo and Rust pool, scheduler launch).
    """

    def __init__(self, model: str = "", *, column: str = "text", output_column: str = "embedding",
                 device: str = "auto", dtype: str = "auto", attention: str = "auto",
                 cuda_graphs: bool = True, prompt: str | None = None,
                 normalize: bool | None = None, truncate: bool = True, dimensions: int = 0,
                 tokenizer_workers: int | None = None, tokenizer_processes: int = 0,
                 settings: SidecarConfig | None = None) -> None:
        # torch and the engine: only in the actor, never where the pipeline is only described.
        from sidecar.gateway import EmbedParams, Gateway
        from sidecar.registry import ModelSource, Registry
        from sidecar.scheduler import Lane

        self.column = column
        self.output_column = output_column
        self._registry = Registry.load([ModelSource.parse(model)], device=device, dtype=dtype,
                                       attention=attention, cuda_graphs=cuda_graphs,
                                       tokenizer_workers=tokenizer_workers,
                                       tokenizer_processes=tokenizer_processes, settings=settings)
        self._params = EmbedParams(lane=Lane.BATCH, prompt_name=prompt or "", normalize=normalize,
                                   truncate=truncate, dimensions=dimensions)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fern-engine-loop",
                                        daemon=True)
        self._thread.start()
        self._run(self._registry.start())
        self._gateway = Gateway(self._registry)
        self.spec = self._registry.get().spec

    def __call__(self, batch: Batch) -> Batch:
        texts = texts_of(batch, self.column)
        return with_vectors(batch, self.output_column, self.embed(texts))

    def embed(self, texts: list[str]) -> np.ndarray:
        """float32 vectors [len(texts), dims] in input order; BatchError names a refused row."""
        parts = []
        for part in slices(len(texts), self._gateway.max_inputs):
            try:
                result = self._run(self._gateway.embed(replace(self._params, texts=texts[part])))
            except EmbedError as error:
                refused = located(error, self.column, part.start)
                if refused is not None:
                    raise refused from None
                raise
            parts.append(result.vectors)
        if not parts:
            dims = self._params.dimensions or self.spec.dimensions
            return np.zeros((0, dims), dtype=np.float32)
        return np.concatenate(parts)

    def _run(self, coroutine: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Finish what the scheduler holds, stop the loop and the tokenizer's workers."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._registry.drain())
        finally:
            self._registry.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
