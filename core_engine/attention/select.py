"""Choosing the attention backend per model and shape: forced by name, or measured on the device."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from core_engine.attention import get_backend, register_backend
from core_engine.attention.base import (AttentionBackend, AttentionMetadata, AttentionPlan, AttentionShape,
                                        PlanningBackend)
from core_engine.graphs import GraphKey
from core_engine.settings import KernelOptions

if TYPE_CHECKING:
    from core_engine.config import ModelSpec

# Milliseconds per step of these token-id sequences with the backends as chosen now; `pipelined`:
# timed back to back, as throughput steps run (the engine's `time_step`).
StepTimer = Callable[[Sequence[Sequence[int]], bool], float]

log = logging.getLogger(__name__)

# Token counts up to this are the "small" (latency) shape class, above it "large" (throughput).
SMALL_STEP_TOKENS = 1024


def _varlen(**_: Any) -> AttentionBackend:
    from core_engine.attention.varlen import VarlenAttention

    return VarlenAttention()


def _flashinfer(**kwargs: Any) -> AttentionBackend:
    from core_engine.attention.flashinfer import FlashInferAttention

    return FlashInferAttention(**kwargs)


register_backend("varlen", _varlen)
register_backend("flashinfer", _flashinfer)


def attention_shape(spec: "ModelSpec") -> AttentionShape:
    """Heads and head size from the model's config.json (already parsed into ``spec.config``)."""
    config = spec.config
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return AttentionShape(heads, int(config.get("num_key_value_heads") or heads), head_dim)


def flashinfer_usable(shape: AttentionShape) -> str | None:
    """None when FlashInfer can serve this head layout, else why not."""
    if shape.head_dim not in (64, 128, 256):
        return f"head_dim {shape.head_dim} (FlashInfer's prefill kernels take 64, 128 or 256)"
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"flashinfer is not installed ({exc})"
    return None


def shape_class(key: GraphKey) -> str:
    """The shape class a measured choice is made for."""
    return "small" if key.tokens <= SMALL_STEP_TOKENS else "large"


class AttentionSelector:
    """The backend the model is built with: it forwards each call to the backend active for the step.

    The engine plans each batch when it prepares it (`plan(key, cu_seqlens_cpu, for_graph,
    backend_for(key, captured))`: host-side work, for FlashInfer, done while the previous
    step runs) and keeps the returned `AttentionPlan` with the batch. When it runs the
    batch it checks that the plan still `holds` for the backend and graph mode the step
    now uses (a replayed graph keeps the backend it was captured with) and plans again if
    not, then `use`s it and runs the model. `choices` maps shape class to backend name.
    """

    def __init__(self, candidates: dict[str, AttentionBackend], forced: str | None) -> None:
        if not candidates:
            raise ValueError("no attention backend available")
        self.candidates = candidates
        self.forced = forced
        first = forced or next(iter(candidates))
        self.choices: dict[str, str] = {"small": first, "large": first}
        self.measurements: dict[str, dict[str, float]] = {}
        self._planning = {name for name, backend in candidates.items() if isinstance(backend, PlanningBackend)}
        self._active_name = first
        self._active = candidates[first]

    @property
    def name(self) -> str:
        return self._active.name

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self._active(q, k, v, meta)

    def backend_for(self, key: GraphKey, captured: str | None = None) -> str:
        """The backend a step of `key` runs on: its graph's when captured, else its shape class's choice."""
        return captured or self.choices[shape_class(key)]

    def activate(self, key: GraphKey, captured: str | None = None) -> str:
        """Make the backend for a step of `key` active and return its name."""
        name = self.backend_for(key, captured)
        self._active_name, self._active = name, self.candidates[name]
        return name

    def plan(self, key: GraphKey, cu_seqlens_cpu: torch.Tensor, for_graph: bool,
             backend: str | None = None) -> AttentionPlan:
        """Plan a batch on `backend` (default: the active one) and make that plan the one the next call runs."""
        name = backend or self._active_name
        state = self.candidates[name].plan(key, cu_seqlens_cpu, for_graph) if name in self._planning else None
        plan = AttentionPlan(backend=name, for_graph=for_graph, state=state)
        self.use(plan)
        return plan

    def holds(self, plan: AttentionPlan, backend: str, for_graph: bool) -> bool:
        """Whether `plan` serves a step on `backend` in this graph mode, and nothing re-planned it since."""
        if plan.backend != backend or plan.for_graph != for_graph:
            return False
        return backend not in self._planning or self.candidates[backend].holds(plan.state)

    def use(self, plan: AttentionPlan) -> None:
        """Make `plan` (its backend and, for a planning backend, its planned state) the one the next call runs."""
        self._active_name, self._active = plan.backend, self.candidates[plan.backend]
        if plan.backend in self._planning:
            self._active.use(plan.state)

    def release(self, key: GraphKey) -> None:
        """A graph of `key` was evicted or failed to capture: backends drop what they kept for it."""
        for backend in self.candidates.values():
            release = getattr(backend, "release", None)
            if release is not None:
                release(key)

    def choose(self, time_step: StepTimer, max_tokens: int, model: str) -> None:
        """Time each candidate on a small and a large step of the model; keep the fastest per class.

        `time_step(sequences, pipelined)` runs the steps as they will serve, with each candidate
        in turn chosen for the class: a small (latency) step serialized, large (throughput)
        steps back to back. `max_tokens` is the model's limit per sequence, `model` its name.
        """
        if self.forced or len(self.candidates) == 1:
            return
        longest = min(max_tokens, 512)
        shapes = {"small": [[0] * min(128, longest)],
                  "large": [[0] * longest] * max(1, 8192 // longest)}
        for cls, seqs in shapes.items():
            times: dict[str, float] = {}
            for name in self.candidates:
                self.choices[cls] = name
                try:
                    times[name] = time_step(seqs, cls == "large")
                except RuntimeError as exc:
                    log.warning("attention backend %s failed on %s (%s); not used", name, model, exc)
            if not times:
                raise RuntimeError(f"no attention backend ran model {model!r}")
            self.choices[cls] = min(times, key=times.get)
            self.measurements[cls] = times
        log.info("attention for %s: %s (measured ms/step %s)", model, self.choices, self.measurements)


@functools.cache
def opaque_selector() -> type[AttentionSelector]:
    """AttentionSelector whose call torch.compile never traces.

    The kernels (and FlashInfer's host-side state) run as they are, between the compiled
    regions of each layer. Made on first use: `torch.compiler.disable` imports torch._dynamo
    (~1.1 s on the 2-core machine), which an engine that does not compile never needs.
    """

    class OpaqueAttentionSelector(AttentionSelector):
        __call__ = torch.compiler.disable(AttentionSelector.__call__)

    return OpaqueAttentionSelector


def make_attention(name: str, device: torch.device, spec: "ModelSpec", dtype: torch.dtype = torch.bfloat16,
                   max_tokens: int = 16384, compiled: bool = False,
                   kernels: KernelOptions | None = None) -> AttentionSelector:
    """The attention the engine builds its model with (`compiled`: for a model torch.compile runs).

    "auto": the CPU path on CPU; on CUDA `varlen` plus FlashInfer where it can serve the model,
    chosen per shape class by measurement once the model is built. A name forces that backend.
    """
    selector = opaque_selector() if compiled else AttentionSelector
    shape = attention_shape(spec)
    kernels = kernels or KernelOptions()
    flashinfer_options = dict(device=device, shape=shape, causal=spec.causal, dtype=dtype, max_tokens=max_tokens,
                              kernel=kernels.flashinfer_backend, contiguous=kernels.flashinfer_contiguous)
    if name == "auto":
        if device.type != "cuda":
            return selector({"cpu": get_backend("cpu")}, forced="cpu")
        candidates: dict[str, AttentionBackend] = {"varlen": get_backend("varlen")}
        why_not = flashinfer_usable(shape)
        if why_not is None:
            candidates["flashinfer"] = get_backend("flashinfer", **flashinfer_options)
        else:
            log.info("FlashInfer not a candidate for %s: %s", spec.name, why_not)
        return selector(candidates, forced=None)
    if name in ("varlen", "flashinfer") and device.type != "cuda":
        raise ValueError(f"attention {name!r} needs a CUDA device, got {device}")
    if name == "flashinfer":
        why_not = flashinfer_usable(shape)
        if why_not is not None:
            raise ValueError(f"attention 'flashinfer' cannot serve {spec.name!r}: {why_not}")
        backend = get_backend("flashinfer", **flashinfer_options)
    else:
        backend = get_backend(name)
    return selector({name: backend}, forced=name)
