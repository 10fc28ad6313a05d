"""Fern's settings: frozen EngineConfig (BucketConfig, KernelOptions) and SidecarConfig; the one place FERN_* is read.

Engine, scheduler and tokenizer modules take these objects and read no environment; `fern
serve` builds both once, from its flags and `from_env()`. (The command-line tools' own env
twins of their flags, such as FERN_TARGET, are read where those flags are defined.)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean FERN_* switch: unset keeps `default`; "0", "false", "no" and "" mean off."""
    value = environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "")


@dataclass(frozen=True)
class BucketConfig:
    """How packed batches are rounded up so that few distinct shapes (and graphs) exist.

    Token counts up to `small_limit` round up to a multiple of `small_step`, larger ones to a
    multiple of `large_step`. Sequence slots round up to a power of two that leaves one slot
    free for the padding tokens; the longest-sequence bound rounds up to a power of two.
    """

    small_step: int = 64
    large_step: int = 256
    small_limit: int = 1024
    min_seqlen: int = 64

    def tokens(self, num_tokens: int) -> int:
        """Token bucket for a batch of `num_tokens` real tokens (at least one step)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        step = self.small_step if num_tokens <= self.small_limit else self.large_step
        return max(step, -(-num_tokens // step) * step)

    def slots(self, num_seqs: int) -> int:
        """Sequence-slot bucket: a power of two > num_seqs (the last slot holds padding)."""
        if num_seqs < 1:
            raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
        return 1 << num_seqs.bit_length()  # smallest power of two strictly greater

    def seqlen(self, longest: int, token_bucket: int) -> int:
        """Bound on any one slot's length: a power of two, at most the token bucket."""
        return min(token_bucket, max(self.min_seqlen, 1 << max(0, longest - 1).bit_length()))


@dataclass(frozen=True)
class KernelOptions:
    """Switches of individual kernels, for measuring one form against another (defaults are what serves)."""

    gelu_epilogue: bool = True  # BERT's GELU as the up-projection's cuBLASLt epilogue on CUDA
    opaque_residual: bool = True  # residual matmuls opaque to torch.compile, so adds fuse into norms
    triton_kernels: bool = True  # Qwen3's fused q/k norm + rotary as a Triton kernel on CUDA
    pool_early: bool = True  # CLS / last-token models run their last layer on the pooled rows only
    flashinfer_backend: str | None = None  # FlashInfer kernel family ("fa2", "fa3"); None: by device
    flashinfer_contiguous: bool | None = None  # contiguous Q/K/V for FlashInfer; None: by kernel family

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelOptions":
        """The switches as FERN_GELU_EPILOGUE, FERN_ADDMM_RESIDUAL, FERN_TRITON_KERNELS,
        FERN_FULL_LAST_LAYER, FERN_FLASHINFER_BACKEND and FERN_FLASHINFER_CONTIGUOUS set them."""
        env = os.environ if environ is None else environ
        contiguous = env.get("FERN_FLASHINFER_CONTIGUOUS")
        return cls(
            gelu_epilogue=env.get("FERN_GELU_EPILOGUE", "1") != "0",
            opaque_residual=env.get("FERN_ADDMM_RESIDUAL", "0") in ("0", ""),
            triton_kernels=env.get("FERN_TRITON_KERNELS") != "0",
            pool_early=env.get("FERN_FULL_LAST_LAYER", "0") in ("0", ""),
            flashinfer_backend=env.get("FERN_FLASHINFER_BACKEND") or None,
            flashinfer_contiguous=None if contiguous is None else contiguous != "0",
        )


@dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` runs one model on one device.

    `attention` "auto" (measured per shape class on CUDA), "varlen", "flashinfer" or "cpu";
    `cuda_graphs=False` runs every step eagerly; `max_graphs` bounds the graphs kept (least
    recently used evicted); `eager_hits` is how many eager steps a shape gets before its
    capture; `max_step_tokens` sizes the static input buffer (larger steps run eagerly);
    `prewarm` lists (tokens per sequence, sequences) shapes captured at start, or is a list
    as `fern serve --prewarm` takes it ("queries", "128x1,512x32"; see graphs.prewarm_shapes);
    `pad_to_buckets` (default: on CUDA) pads token counts to graph buckets; `compile`
    (default: on CUDA) runs the model through torch.compile with `compile_backend`;
    `compile_in_background` makes the engine ready at once, serving from the uncompiled model
    (and, under "auto" attention, varlen alone) while a thread compiles, chooses attention and
    pre-warms a second runner on the same weights, adopted at the next step once ready.
    """

    device: Any = "auto"  # str or torch.device
    dtype: Any = "auto"  # str or torch.dtype
    attention: str = "auto"
    cuda_graphs: bool = True
    max_graphs: int = 256
    eager_hits: int = 1
    max_step_tokens: int = 65536
    buckets: BucketConfig = field(default_factory=BucketConfig)
    prewarm: Sequence[tuple[int, int]] | str = ()
    pad_to_buckets: bool | None = None
    compile: bool | None = None
    compile_backend: str = "inductor"
    compile_in_background: bool = False
    kernels: KernelOptions = field(default_factory=KernelOptions)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> "EngineConfig":
        """`options` as given, the rest from FERN_COMPILE, FERN_COMPILE_BACKEND, FERN_COMPILE_IN_BACKGROUND and
        the kernel switches."""
        env = os.environ if environ is None else environ
        base: dict[str, Any] = {"kernels": KernelOptions.from_env(env),
                                "compile_backend": env.get("FERN_COMPILE_BACKEND", "inductor")}
        if env.get("FERN_COMPILE") is not None:
            base["compile"] = _flag(env, "FERN_COMPILE", True)
        if env.get("FERN_COMPILE_IN_BACKGROUND") is not None:
            base["compile_in_background"] = _flag(env, "FERN_COMPILE_IN_BACKGROUND", False)
        base.update(options)
        return cls(**base)

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with `changes` (field names) applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SidecarConfig:
    """How the serving process around the engines behaves (scheduler fast paths, tokenizer memo).

    `launch_on_arrival`: an ONLINE request that finds an asynchronous (CUDA) engine idle is
    prepared and launched on the event loop as it is admitted, instead of waking the engine's
    thread. `online_poll_s`: how long the loop then polls that step's result between its other
    callbacks before a thread waits for it (0: the engine's thread collects it).
    `token_memo_chunks`: entries of the tokenizer's chunk memo (0 turns it off).
    `tokenizer_rust_threads`: threads of the `tokenizers` library's Rust pool (None: one per core).
    `gil_switch_interval_s`: how long a thread that holds the GIL runs before one waiting for it
    (the event loop with a query, while the engine's thread packs a bulk step) takes it over;
    None leaves Python's own (5 ms).
    """

    launch_on_arrival: bool = True
    online_poll_s: float = 0.020
    token_memo_chunks: int = 1 << 15
    tokenizer_rust_threads: int | None = None
    gil_switch_interval_s: float | None = None

    def __post_init__(self) -> None:
        if self.online_poll_s < 0:
            raise ValueError(f"online_poll_s must be >= 0, got {self.online_poll_s}")
        if self.token_memo_chunks < 0:
            raise ValueError(f"token_memo_chunks must be >= 0, got {self.token_memo_chunks}")
        if self.tokenizer_rust_threads is not None and self.tokenizer_rust_threads < 1:
            raise ValueError(f"tokenizer_rust_threads must be >= 1, got {self.tokenizer_rust_threads}")
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError(f"gil_switch_interval_s must be > 0, got {self.gil_switch_interval_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SidecarConfig":
        """FERN_LAUNCH_ON_ARRIVAL, FERN_ONLINE_POLL_MS, FERN_TOKEN_MEMO_CHUNKS, FERN_GIL_SWITCH_MS and Rayon's
        own RAYON_NUM_THREADS (the tokenizers' Rust pool) over the defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {"launch_on_arrival": _flag(env, "FERN_LAUNCH_ON_ARRIVAL", True)}
        for name, key, scale in (("FERN_ONLINE_POLL_MS", "online_poll_s", 1e-3),
                                 ("FERN_TOKEN_MEMO_CHUNKS", "token_memo_chunks", None),
                                 ("FERN_GIL_SWITCH_MS", "gil_switch_interval_s", 1e-3),
                                 ("RAYON_NUM_THREADS", "tokenizer_rust_threads", None)):
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[key] = float(raw) * scale if scale else int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: not a number") from None
        return cls(**values)
