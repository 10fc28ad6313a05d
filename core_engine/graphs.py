"""Whole-model CUDA graph cache: shape buckets, the lazy capture policy (eager, capture, replay) and an LRU bound."""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from core_engine.settings import BucketConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphKey:
    """The static shape one graph is captured for."""

    tokens: int      # padded token count T
    slots: int       # sequence slots S (cu_seqlens has S + 1 entries)
    max_seqlen: int  # bound on any slot's length, fixed inside the graph
    token_outputs: bool = False  # the step also yields its token heads' rows (core_engine.heads)


def key_for(lengths: Iterable[int], buckets: BucketConfig) -> GraphKey:
    """The bucketed key of a batch with these sequence lengths (padding included in the bound)."""
    lengths = list(lengths)
    total = sum(lengths)
    tokens = buckets.tokens(total)
    longest = max(max(lengths, default=0), tokens - total)
    return GraphKey(tokens=tokens, slots=buckets.slots(len(lengths)),
                    max_seqlen=buckets.seqlen(longest, tokens))


# `prewarm="queries"`: one sequence at every small token bucket up to this length (or the
# model's limit): the shapes of single queries, each captured before the first one arrives.
QUERY_PREWARM_TOKENS = 512


def prewarm_shapes(text: str, max_tokens: int, buckets: BucketConfig) -> list[tuple[int, int]]:
    """(tokens per sequence, sequences) shapes from a pre-warm list as `fern serve --prewarm` takes it.

    "" or "none": nothing. "queries": one sequence at each small bucket up to QUERY_PREWARM_TOKENS
    (or `max_tokens`). Otherwise comma-separated LENGTHxCOUNT items ("128x1,512x32"); "queries"
    may be one of them. Errors name the item.
    """
    shapes: list[tuple[int, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if item in ("", "none"):
            continue
        if item == "queries":
            limit = min(max_tokens, QUERY_PREWARM_TOKENS)
            lengths = list(range(buckets.small_step, limit + 1, buckets.small_step))
            if not lengths or lengths[-1] != limit:
                lengths.append(limit)
            shapes += [(length, 1) for length in lengths]
            continue
        length, sep, count = item.partition("x")
        if not (sep and length.isdigit() and count.isdigit()):
            raise ValueError(f"prewarm: {item!r} is not LENGTHxCOUNT (tokens per sequence x sequences, "
                             "e.g. 128x1) or 'queries'")
        if not 1 <= int(length) <= max_tokens or int(count) < 1:
            raise ValueError(f"prewarm: {item!r} needs 1 to {max_tokens} tokens per sequence (the model's "
                             "limit) and at least one sequence")
        shapes.append((int(length), int(count)))
    return shapes


class Action(enum.Enum):
    """What the engine does for one step of a given key."""

    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class GraphCounters:
    """How steps were run, for metrics and benchmarks."""

    eager_runs: int = 0
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    uncacheable: int = 0  # steps too large for the static buffers: always eager

    def as_dict(self) -> dict[str, int]:
        return dict(eager_runs=self.eager_runs, captures=self.captures, replays=self.replays,
                    evictions=self.evictions, uncacheable=self.uncacheable)


@dataclass
class CapturePolicy:
    """Lazy capture: a key's first `eager_hits` steps run eagerly, the next captures, later ones replay.

    Holds at most `max_graphs` captured keys; the least recently used is evicted first.
    Pure bookkeeping (no CUDA), so it is tested on any machine.
    """

    max_graphs: int = 256
    eager_hits: int = 1
    counters: GraphCounters = field(default_factory=GraphCounters)
    _seen: dict[GraphKey, int] = field(default_factory=dict)
    _captured: "OrderedDict[GraphKey, None]" = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {self.max_graphs}")
        if self.eager_hits < 0:
            raise ValueError(f"eager_hits must be >= 0, got {self.eager_hits}")

    def peek(self, key: GraphKey) -> Action:
        """What `decide(key)` would answer now, with nothing counted (to plan a step ahead)."""
        if key in self._captured:
            return Action.REPLAY
        if self.max_graphs == 0 or self._seen.get(key, 0) < self.eager_hits:
            return Action.EAGER
        return Action.CAPTURE

    def decide(self, key: GraphKey) -> Action:
        """Choose how to run this step and count it."""
        action = self.peek(key)
        if action is Action.REPLAY:
            self._captured.move_to_end(key)
            self.counters.replays += 1
            return action
        if self.max_graphs:  # without graphs there is nothing to count up to (and no key to remember)
            self._seen[key] = self._seen.get(key, 0) + 1
        if action is Action.EAGER:
            self.counters.eager_runs += 1
        else:
            self.counters.captures += 1
        return action

    def captured(self, key: GraphKey) -> list[GraphKey]:
        """Record a finished capture; returns the keys evicted to respect the bound."""
        self._captured[key] = None
        self._captured.move_to_end(key)
        self._seen.pop(key, None)
        evicted: list[GraphKey] = []
        while len(self._captured) > self.max_graphs:
            old, _ = self._captured.popitem(last=False)
            evicted.append(old)
            self.counters.evictions += 1
        return evicted

    def capture_failed(self, key: GraphKey) -> None:
        """A capture that raised runs eagerly from then on (it is not retried)."""
        self.counters.captures -= 1
        self.counters.eager_runs += 1
        self._seen[key] = -(1 << 62)

    def cached_keys(self) -> list[GraphKey]:
        """Captured keys, least recently used first."""
        return list(self._captured)


@dataclass
class _Entry:
    graph: "torch.cuda.CUDAGraph"
    output: torch.Tensor | tuple[torch.Tensor, ...]
    backend: str


class GraphCache:
    """CUDA graphs per key, driven by a CapturePolicy; graphs share one memory pool.

    `capture_lock`, when given, is held through every capture (captures of two graph caches, one
    of them filled by a background compile, never overlap).

    The engine asks `peek(key)` when it prepares a batch (to plan attention for the graph
    or eager step it expects), `decide(key)` when it runs it, then `run(key, action,
    forward, backend)`, which runs `forward()` eagerly, captures it, or replays its graph.
    `forward` must read its inputs from static device buffers that the caller fills before
    each step. The graphs never run concurrently (one stream), which is what makes sharing
    their pool safe. `on_evict(key)` is called for every graph dropped by the LRU bound, and
    for a key whose capture failed (it runs eagerly from then on, so never holds a graph).
    On the CPU only the bookkeeping runs (the engine's CPU policy keeps no graphs).
    """

    def __init__(self, policy: CapturePolicy, device: torch.device,
                 on_evict: Callable[[GraphKey], None] | None = None,
                 capture_lock: threading.Lock | None = None) -> None:
        self.policy = policy
        self.device = device
        self.on_evict = on_evict
        self._capture_lock = capture_lock or contextlib.nullcontext()
        self._entries: dict[GraphKey, _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every graph (the engine switched to another runner); the counters stay."""
        for key in list(self._entries):
            del self._entries[key]
            if self.on_evict is not None:
                self.on_evict(key)

    def backend_of(self, key: GraphKey) -> str | None:
        """Which attention backend a captured graph was recorded with."""
        entry = self._entries.get(key)
        return entry.backend if entry else None

    def peek(self, key: GraphKey) -> Action:
        """The decision `decide(key)` would make now, not counted (for planning while an earlier step runs)."""
        return self.policy.peek(key)

    def decide(self, key: GraphKey) -> Action:
        """The policy's decision for this step of `key` (counted)."""
        return self.policy.decide(key)

    def run(self, key: GraphKey, action: Action, forward: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]],
            backend: str) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run one step of `key` as decided: eagerly, by capturing `forward`, or by replaying."""
        if action is Action.REPLAY:
            entry = self._entries[key]
            entry.graph.replay()
            return entry.output
        if action is Action.EAGER:
            return forward()
        graph = torch.cuda.CUDAGraph()
        try:
            with self._capture_lock, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = forward()
        except RuntimeError as exc:
            # A model or backend that cannot be captured still serves, eagerly, for this key.
            log.warning("CUDA graph capture failed for %s (%s); running it eagerly from now on", key, exc)
            self.policy.capture_failed(key)
            # The key will never hold a graph, so it will never be evicted either: what the
            # attention backend made for its graph (a FlashInfer graph wrapper) is released now.
            # This step still runs on the plan it was given; the key's later steps plan eagerly.
            if self.on_evict is not None:
                self.on_evict(key)
            return forward()
        self._entries[key] = _Entry(graph=graph, output=output, backend=backend)
        for old in self.policy.captured(key):
            self._entries.pop(old, None)
            if self.on_evict is not None:
                self.on_evict(old)
        # Capturing recorded the work without running it; replay once for this step.
        graph.replay()
        return output
