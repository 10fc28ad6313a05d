"""The engine: packs token sequences into bucketed batches and runs them (eagerly or as CUDA graphs) to pooled vectors."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from core_engine.attention.base import AttentionPlan
from core_engine.attention.select import AttentionSelector, make_attention
from core_engine.batch import model_inputs, pack_into, packed_size, regions
from core_engine.config import ModelSpec, default_model_dir, load_spec
from core_engine.graphs import (Action, BucketConfig, CapturePolicy, GraphCache, GraphCounters, GraphKey, key_for,
                                prewarm_shapes)
from core_engine.handle import EmbeddingHandle
from core_engine.loader import build_model, rebuild_model
from core_engine.settings import EngineConfig

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" means the first CUDA GPU when there is one, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a torch device (try auto, cpu, cuda, cuda:1)") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" means bf16 on CUDA and fp32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of auto, {', '.join(_DTYPES)}") from None


@dataclass
class PreparedBatch:
    """One step's inputs, packed on the host (pinned on CUDA) in a single int64 buffer (layout: core_engine.batch)."""

    packed: torch.Tensor
    key: GraphKey
    num_seqs: int            # real sequences B (the first B slots)
    num_tokens: int          # real tokens
    cu_seqlens_cpu: torch.Tensor  # int32 [S + 1] host copy (FlashInfer's plan, CPU attention)
    # Attention planned for this batch when it was prepared (the backend, graph or eager, and
    # the FlashInfer wrapper it must run on), on which runner; step() re-plans only if it no
    # longer holds.
    plan: AttentionPlan | None = None
    runner: "_Runner | None" = None

    @property
    def input_ids(self) -> torch.Tensor:
        return regions(self.packed, self.key)[0]

    @property
    def positions(self) -> torch.Tensor:
        return regions(self.packed, self.key)[1]

    @property
    def seq_ids(self) -> torch.Tensor:
        return regions(self.packed, self.key)[2]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return regions(self.packed, self.key)[3]

    @property
    def seq_lens(self) -> torch.Tensor:
        return regions(self.packed, self.key)[4]


@dataclass
class _Runner:
    """One way the engine runs steps: the model and the attention it calls, its forward (compiled or not),
    the CUDA graphs captured of that forward and the static input buffer they read. An engine that
    compiles in the background swaps the whole runner at once."""

    model: torch.nn.Module
    attention: AttentionSelector
    forward: Callable[..., Any]
    graphs: GraphCache
    static: torch.Tensor | None
    compiled: bool
    # Serving while another thread compiles (CUDA): its steps launch under the capture lock and
    # capture nothing (see Engine._compile_in_background).
    interim: bool = False


class Engine:
    """One model on one device: `prepare()` packs (and plans attention) on the CPU, `step()` runs and returns a handle.

    On CUDA, token counts are padded to buckets and each bucket's whole forward pass (pooling
    included) becomes a CUDA graph lazily: the first step of a shape runs eagerly, the next
    captures, later ones replay. Only the pooled vectors travel back, through pinned memory.

    How it runs is an `EngineConfig` (see there for each option). The keyword options, where
    given, override fields of `config`; without `config`, the fields come from
    `EngineConfig.from_env()`, so FERN_* switches still reach an engine built by keywords.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        name: str | None = None,
        config: EngineConfig | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        attention: str | None = None,
        cuda_graphs: bool | None = None,
        max_graphs: int | None = None,
        eager_hits: int | None = None,
        max_step_tokens: int | None = None,
        buckets: BucketConfig | None = None,
        prewarm: Sequence[tuple[int, int]] | str | None = None,
        pad_to_buckets: bool | None = None,
        compile: bool | None = None,
        compile_in_background: bool | None = None,
    ) -> None:
        started = time.perf_counter()
        overrides = {key: value for key, value in dict(
            device=device, dtype=dtype, attention=attention, cuda_graphs=cuda_graphs, max_graphs=max_graphs,
            eager_hits=eager_hits, max_step_tokens=max_step_tokens, buckets=buckets, prewarm=prewarm,
            pad_to_buckets=pad_to_buckets, compile=compile,
            compile_in_background=compile_in_background).items() if value is not None}
        config = (config or EngineConfig.from_env()).replace(**overrides)
        self.config = config
        self.spec: ModelSpec = load_spec(model_dir if model_dir is not None else default_model_dir(), name)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.buckets = config.buckets
        # A bad pre-warm list fails here, before the weights load.
        shapes = prewarm_shapes(config.prewarm, self.spec.max_tokens, self.buckets) \
            if isinstance(config.prewarm, str) else list(config.prewarm)
        max_step_tokens = config.max_step_tokens
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        self.max_step_tokens = max_step_tokens
        step_bucket = self.buckets.tokens(max_step_tokens)
        # Captured steps read their inputs from one static buffer of this many int64s.
        self._static_size = packed_size(step_bucket, self.buckets.slots(max_step_tokens))
        for length, count in shapes:
            if not self._fits_static(key_for([length] * count, self.buckets)):
                raise ValueError(f"prewarm: {length}x{count} ({length * count} tokens) does not fit the static "
                                 f"buffers captured steps read from (max_step_tokens {max_step_tokens}); "
                                 "such steps run eagerly, so there is nothing to capture")
        # Positions of packed steps are slices of this (steps beyond the static buffers make their own).
        self._ramp = np.arange(max(step_bucket, self.spec.max_tokens), dtype=np.int64)
        self._cuda = self.device.type == "cuda"
        # torch.compile fuses the elementwise work between matmuls (norms, rotary, activations,
        # residuals); attention stays outside the compiled regions (a graph break per layer),
        # so every backend works unchanged. The compiled code is then recorded into the same
        # CUDA graphs. Default: on for CUDA, off for the CPU.
        want_compile = self._cuda if config.compile is None else bool(config.compile)
        # In the background, the engine serves at once from the uncompiled model on the attention
        # that needs no JIT (varlen; FlashInfer's kernels compile with the model) and switches
        # to a compiled runner when it is ready (`_compile_in_background`).
        background = want_compile and config.compile_in_background
        self._attention_options = dict(device=self.device, spec=self.spec, dtype=self.dtype, max_tokens=step_bucket,
                                       kernels=config.kernels)
        first_attention = "varlen" if background and self._cuda and config.attention == "auto" else config.attention
        attention = make_attention(first_attention, compiled=want_compile and not background,
                                   **self._attention_options)
        attended = time.perf_counter()
        model = build_model(self.spec, self.device, self.dtype, attention, config.kernels)
        model.eval()
        built = time.perf_counter()
        self.compile_seconds = 0.0
        self.compile_error: str | None = None
        choose_seconds = 0.0
        # Bucket padding exists for CUDA graphs; on the CPU it only costs time, but it can be
        # switched on there to exercise the same packing.
        self.pad_to_buckets = self._cuda if config.pad_to_buckets is None else config.pad_to_buckets
        self._max_graphs = config.max_graphs if (config.cuda_graphs and self._cuda) else 0
        # Counted across runners: the metrics see one engine however often its runner changed.
        self._counters = GraphCounters()
        # Captures are serialized: a background compile captures while the serving runner may too.
        self._capture_lock = threading.Lock()
        self._pending: _Runner | None = None
        self._compiled_event = threading.Event()
        self._runner = self._new_runner(model, attention, compiled=want_compile and not background,
                                        interim=background and self._cuda)
        if self._runner.compiled:
            self._runner = self._compile(self._runner, built)
            self._compiled_event.set()
        if self._cuda:
            chosen = time.perf_counter()
            # Measured choice when attention="auto" (no-op when forced), before any graph is kept.
            self._choose(self._runner)
            choose_seconds = time.perf_counter() - chosen
        prewarmed = time.perf_counter()
        self.prewarm = shapes if self._max_graphs else []
        if shapes and not self.prewarm:
            log.info("%s: no CUDA graphs on %s, so nothing to pre-warm", self.spec.name, self.device)
        if not background:
            for length, count in self.prewarm:
                self._warmup(self._runner, length, count)
        self.load_seconds = time.perf_counter() - started
        # Where start-up went: the spec, the device and the attention backends (importing FlashInfer,
        # and torch._dynamo for a compiled model); the weights (the first CUDA use initializes the
        # context); torch.compile (importing it, and its warm-up); the measured attention choice;
        # pre-warmed graphs. With the compile in the background, its seconds come later
        # (`compile_seconds`, once `compiled`).
        self.startup_seconds = {"attention": round(attended - started, 3), "weights": round(built - attended, 3),
                                "compile": round(self.compile_seconds, 3),
                                "choose_attention": round(choose_seconds, 3),
                                "prewarm": round(time.perf_counter() - prewarmed, 3)}
        log.info("%s ready on %s in %.1f s (%s)%s", self.spec.name, self.device, self.load_seconds,
                 ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_seconds.items()),
                 "; compiling in the background" if background else "")
        self._compiler: threading.Thread | None = None
        if background:
            self._compiler = threading.Thread(target=self._compile_in_background, name=f"fern-compile-{self.spec.name}",
                                              daemon=True)
            self._compiler.start()

    # -- runners --------------------------------------------------------------------------

    def _new_runner(self, model: torch.nn.Module, attention: AttentionSelector, compiled: bool,
                    counters: GraphCounters | None = None, interim: bool = False) -> _Runner:
        """`counters`: where its steps are counted (default: the engine's); `interim`: serves while another
        thread compiles, without graphs."""
        # Wrapping the model imports torch._inductor (seconds on a slow host): counted as compile time.
        forward = torch.compile(model, dynamic=True, backend=self.config.compile_backend) if compiled else model
        policy = CapturePolicy(max_graphs=0 if interim else self._max_graphs, eager_hits=self.config.eager_hits,
                               counters=counters or self._counters)
        graphs = GraphCache(policy, self.device, on_evict=attention.release, capture_lock=self._capture_lock)
        static = torch.zeros(self._static_size, dtype=torch.int64, device=self.device) if self._cuda else None
        return _Runner(model=model, attention=attention, forward=forward, graphs=graphs, static=static,
                       compiled=compiled, interim=interim)

    def _compile(self, runner: _Runner, since: float) -> _Runner:
        """`runner` with its compiled forward warmed up, or an uncompiled runner of the same model when the
        compiler fails (the engine serves either way; `compile_error` says why)."""
        try:
            self._compile_warmup(runner)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: serve uncompiled
            log.warning("torch.compile failed for %s (%s: %s); running uncompiled",
                        self.spec.name, type(exc).__name__, exc)
            self.compile_error = f"{type(exc).__name__}: {exc}"
            runner = self._new_runner(runner.model, runner.attention, compiled=False)
        self.compile_seconds = time.perf_counter() - since
        if runner.compiled:
            log.info("compiled %s in %.1f s", self.spec.name, self.compile_seconds)
        return runner

    def _choose(self, runner: _Runner) -> None:
        runner.attention.choose(lambda seqs, pipelined: self._time_step(runner, seqs, pipelined),
                                self.spec.max_tokens, self.spec.name)

    def _compile_in_background(self) -> None:
        """Build, compile, choose attention for and pre-warm a second runner while the first serves; `_current`
        adopts it at the next step. It shares the served model's weights but has attention, graphs and
        static buffer of its own, and runs on a stream of its own (CUDA).

        A CUDA graph capture tolerates no other thread's launches, allocations or kernel loads while
        it records, and the compiler does all of those at times of its own choosing. So the interim
        runner captures nothing (its steps run eagerly), and its launches and this thread's captures
        (the attention choice, the pre-warm) take turns under the capture lock."""
        began = time.perf_counter()
        try:
            stream = torch.cuda.Stream(self.device) if self._cuda else None
            with torch.inference_mode(), self._on_device(), \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                attention = make_attention(self.config.attention, compiled=True, **self._attention_options)
                model = rebuild_model(self.spec, self._runner.model, attention, self.config.kernels)
                # Counted apart (the serving thread counts its own steps meanwhile), added in when adopted.
                runner = self._compile(self._new_runner(model, attention, compiled=True, counters=GraphCounters()),
                                       began)
                if not runner.compiled:
                    return
                if self._cuda:
                    self._choose(runner)
                for length, count in self.prewarm:
                    self._warmup(runner, length, count)
                if stream is not None:
                    stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - the engine keeps serving uncompiled
            log.warning("background compile of %s failed (%s: %s); serving uncompiled",
                        self.spec.name, type(exc).__name__, exc)
            self.compile_error = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.compile_seconds = time.perf_counter() - began
        self._pending = runner
        log.info("%s: compiled runner ready after %.1f s in the background; it serves from the next step",
                 self.spec.name, self.compile_seconds)

    def _current(self) -> _Runner:
        """The runner steps use now: a pending compiled one is adopted first (on the caller's thread, which
        the scheduler serializes with every other prepare and step)."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            old, self._runner = self._runner, pending
            policy = pending.graphs.policy
            for name, count in policy.counters.as_dict().items():
                setattr(self._counters, name, getattr(self._counters, name) + count)
            policy.counters = self._counters
            if self._cuda:
                # Steps of the old runner may still be on the GPU: finish them before its graphs go.
                torch.cuda.synchronize(self.device)
            old.graphs.clear()
            self._compiled_event.set()
        return self._runner

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the compiled runner serves (or the compile finished without one); False on timeout.
        An engine that compiles in the background adopts its runner at a step: this one takes that step
        itself when nothing else did."""
        thread = self._compiler
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._current()
        return True

    @property
    def compiled(self) -> bool:
        """Whether the next step runs through torch.compile (a compiled runner serves, or waits to be adopted)."""
        return self._runner.compiled or self._pending is not None

    @property
    def compiling(self) -> bool:
        """Whether a background compile is still under way."""
        return self._compiler is not None and self._compiler.is_alive()

    @property
    def model(self) -> torch.nn.Module:
        return self._runner.model

    @property
    def attention(self) -> AttentionSelector:
        return self._runner.attention

    @property
    def graphs(self) -> GraphCache:
        return self._runner.graphs

    @property
    def policy(self) -> CapturePolicy:
        return self._runner.graphs.policy

    # -- host side ------------------------------------------------------------------------

    @property
    def has_token_heads(self) -> bool:
        """Whether the model has a learned sparse or ColBERT head (core_engine.heads)."""
        return bool(self.spec.sparse_head or self.spec.colbert_dim)

    def prepare(self, sequences: Sequence[Sequence[int]], token_outputs: bool = False) -> PreparedBatch:
        """Pack token-id sequences (special tokens included) into one step's host buffer.

        `token_outputs`: the step also returns its token heads' rows (its handle's result() is
        then a core_engine.token_outputs.StepResult); only for a model with heads.
        Planned on the runner serving now; a compiled runner is adopted by `step` alone (which
        plans again), so a prepare on the event loop never waits for the switch.
        """
        return self._prepare_on(self._runner, sequences, token_outputs)

    def _pack(self, sequences: Sequence[Sequence[int]], token_outputs: bool = False) -> PreparedBatch:
        """The batch packed on the host, not planned on any runner yet."""
        if token_outputs and not self.has_token_heads:
            raise ValueError(f"token_outputs: model {self.spec.name!r} has no sparse_linear.pt or "
                             "colbert_linear.pt head")
        num_seqs = len(sequences)
        if num_seqs == 0:
            raise ValueError("sequences: empty batch")
        lengths = [len(s) for s in sequences]
        limit, longest = self.spec.max_tokens, max(lengths)
        if min(lengths) < 1 or longest > limit:
            i = next(i for i, n in enumerate(lengths) if not 1 <= n <= limit)
            raise ValueError(f"sequences[{i}]: {lengths[i]} tokens; each sequence needs 1 to "
                             f"{limit} tokens for model {self.spec.name!r}")
        total = sum(lengths)
        if self.pad_to_buckets:
            key = key_for(lengths, self.buckets)
        else:
            key = GraphKey(tokens=total, slots=num_seqs, max_seqlen=longest)
        if token_outputs:
            key = dataclasses.replace(key, token_outputs=True)
        packed = torch.empty(packed_size(key.tokens, key.slots), dtype=torch.int64, pin_memory=self._cuda)
        cu = pack_into(packed.numpy(), key, sequences, lengths, total, self._ramp)
        return PreparedBatch(packed=packed, key=key, num_seqs=num_seqs, num_tokens=total,
                             cu_seqlens_cpu=torch.from_numpy(cu.astype(np.int32)))

    def _prepare_on(self, runner: _Runner, sequences: Sequence[Sequence[int]],
                    token_outputs: bool = False) -> PreparedBatch:
        batch = self._pack(sequences, token_outputs)
        # Plan attention now: the scheduler prepares step N+1 while step N runs on the GPU, so
        # FlashInfer's host-side plan (0.1-1.3 ms) overlaps N instead of delaying N+1's launch.
        # The graph decision is peeked, not counted; step() decides for real and re-plans if
        # the step turned out otherwise or another batch was planned on the same wrapper since.
        with self._on_device():
            self._plan(runner, batch, self._action(runner, batch, counted=False))
        return batch

    # -- device side ----------------------------------------------------------------------

    def _forward_on(self, runner: _Runner, buf: torch.Tensor, key: GraphKey,
                    cu_cpu: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        inputs = model_inputs(buf, key, self.spec.causal, cu_cpu)
        if key.token_outputs:
            return runner.forward(*inputs, token_outputs=True)
        return runner.forward(*inputs)

    def _on_device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()

    def _fits_static(self, key: GraphKey) -> bool:
        """Whether a step of `key` fits the static input buffer (else it always runs eagerly)."""
        return packed_size(key.tokens, key.slots) <= self._static_size

    def _action(self, runner: _Runner, batch: PreparedBatch, counted: bool) -> Action | None:
        """How `batch` runs: the graph policy's action, or None when it exceeds the static buffers
        (always eager, from its own device copy). `counted=False` peeks without side effects."""
        if runner.static is not None and not self._fits_static(batch.key):
            if counted:
                runner.graphs.policy.counters.uncacheable += 1
            return None
        return runner.graphs.decide(batch.key) if counted else runner.graphs.peek(batch.key)

    def _plan(self, runner: _Runner, batch: PreparedBatch, action: Action | None) -> AttentionPlan:
        """The batch's attention plan for a step run as `action`: the one it carries if that still
        holds, else a new one (kept with the batch).

        The carried plan can be stale: the decision differs from the one peeked at prepare()
        (a step of the same key ran in between and captured or evicted its graph), or another
        batch was planned on the same FlashInfer wrapper since (a jump step launched before
        this one, a prepared batch that was dropped). A graph step of a key always plans
        that key's own wrapper, before its capture or replay. A batch prepared on another runner
        (before the compiled one was adopted) plans again on this one.
        """
        if batch.runner is not runner:
            batch.plan, batch.runner = None, runner
        attention = runner.attention
        captured = runner.graphs.backend_of(batch.key) if action is not None else None
        backend = attention.backend_for(batch.key, captured)
        for_graph = action is not None and action is not Action.EAGER
        if batch.plan is None or not attention.holds(batch.plan, backend, for_graph):
            batch.plan = attention.plan(batch.key, batch.cu_seqlens_cpu, for_graph, backend)
        return batch.plan

    def replays(self, batch: PreparedBatch) -> bool:
        """Whether `step(batch)` would replay a captured graph now: a launch of tens of microseconds,
        where an eager step or a capture costs milliseconds of host work. Nothing is counted; a compiled
        runner waiting to be adopted makes it False (the step that adopts it belongs on the engine's thread)."""
        runner = self._runner
        if self._pending is not None or batch.runner is not runner:
            return False
        return self._action(runner, batch, counted=False) is Action.REPLAY

    @torch.inference_mode()
    def step(self, batch: PreparedBatch) -> EmbeddingHandle:
        """Run one prepared batch; on CUDA this returns before the GPU has finished."""
        with self._on_device():
            return self._step_on(self._current(), batch)

    def _step_on(self, runner: _Runner, batch: PreparedBatch) -> EmbeddingHandle:
        if runner.interim:
            with self._capture_lock:
                return self._launch(runner, batch)
        return self._launch(runner, batch)

    def _launch(self, runner: _Runner, batch: PreparedBatch) -> EmbeddingHandle:
        key, cu_cpu = batch.key, batch.cu_seqlens_cpu
        action = self._action(runner, batch, counted=True)
        plan = self._plan(runner, batch, action)
        runner.attention.use(plan)  # this batch's own plan, whatever was planned after it
        if action is None:  # too large for the static buffers: eager, from its own device copy
            buf = batch.packed.to(self.device, non_blocking=True)
            pooled = self._forward_on(runner, buf, key, cu_cpu)
        else:
            buf = batch.packed
            if runner.static is not None:  # a graph reads its inputs from the static buffer
                buf = runner.static[: buf.numel()]
                buf.copy_(batch.packed, non_blocking=True)
            pooled = runner.graphs.run(key, action, lambda: self._forward_on(runner, buf, key, cu_cpu), plan.backend)
        tokens = None
        if key.token_outputs:
            pooled, values = pooled
            tokens = (values, cu_cpu[: batch.num_seqs + 1].numpy().astype(np.int64), bool(self.spec.sparse_head))
        if not self._cuda:
            return EmbeddingHandle.ready(pooled, batch.num_seqs, tokens)
        return EmbeddingHandle.from_device(pooled, batch.num_seqs, tokens)

    def embed(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """prepare + step + result: float32 [N, dimensions] raw pooled vectors, input order."""
        return self.step(self.prepare(sequences)).result()

    def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """A reranker's raw scores (logits), float32 [N], input order: one per packed (query, document) sequence.

        Each sequence is a pair as `sidecar.tokenize.pairs` builds it (type-1 tokens at
        ``id + vocab_size``)."""
        if self.spec.kind != "reranker":
            raise ValueError(f"model {self.spec.name!r} is an {self.spec.kind} model; only a reranker scores pairs")
        return self.embed(sequences)[:, 0]

    def warmup(self, length: int, count: int = 1) -> None:
        """Run a batch of `count` sequences of `length` tokens until its graph is captured."""
        with self._on_device():
            self._warmup(self._current(), length, count)

    @torch.inference_mode()
    def _warmup(self, runner: _Runner, length: int, count: int) -> None:
        batch = self._prepare_on(runner, [[0] * length] * count)
        for _ in range(self.config.eager_hits + 1):
            self._step_on(runner, batch).result()

    def _compile_warmup(self, runner: _Runner) -> None:
        """Compile before serving: two eager passes of different shapes settle the dynamic-shape code."""
        longest = min(self.spec.max_tokens, 256)
        shapes = [([[0] * 8], False), ([[0] * longest] * 3, False)]
        if self.has_token_heads:  # the forward with token outputs is compiled code of its own
            shapes += [([[0] * 8], True), ([[0] * longest] * 3, True)]
        for seqs, token_outputs in shapes:
            batch = self._pack(seqs, token_outputs)
            with torch.inference_mode(), self._on_device():
                for name in runner.attention.candidates:
                    runner.attention.plan(batch.key, batch.cu_seqlens_cpu, for_graph=False, backend=name)
                    self._forward_on(runner, batch.packed.to(self.device), batch.key, batch.cu_seqlens_cpu)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def time_step(self, sequences: Sequence[Sequence[int]], pipelined: bool = False, repeats: int = 30) -> float:
        """Median milliseconds per step of `sequences` through a CUDA graph, on the attention backend chosen
        now for its shape class; the graph cache and its counters are left alone.

        Serialized: host plan + replay + wait, as a lone request pays. Pipelined, as the scheduler
        runs back-to-back steps: plan step N+1 while N runs, wait for N, replay N+1; a step costs
        the time between two consecutive completions, so a plan shorter than the replay it
        overlaps costs nothing.
        """
        return self._time_step(self._current(), sequences, pipelined, repeats)

    @torch.inference_mode()
    def _time_step(self, runner: _Runner, sequences: Sequence[Sequence[int]], pipelined: bool = False,
                   repeats: int = 30) -> float:
        if not self._cuda:
            raise RuntimeError(f"time_step replays CUDA graphs; this engine runs on {self.device}")
        batch = self._pack(sequences)
        attention, key, cu_cpu = runner.attention, batch.key, batch.cu_seqlens_cpu
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            buf = batch.packed.to(self.device)
            attention.activate(key)
            attention.plan(key, cu_cpu, for_graph=True)
            self._forward_on(runner, buf, key, cu_cpu)  # warm: JIT, compile, workspaces
            graph = torch.cuda.CUDAGraph()
            with self._capture_lock, torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._forward_on(runner, buf, key, cu_cpu)
            stream.synchronize()
            times = []
            if pipelined:
                done = torch.cuda.Event()
                finished = []
                for _ in range(repeats + 4):
                    attention.plan(key, cu_cpu, for_graph=True)  # overlaps the replay in flight
                    done.synchronize()  # that replay has finished (at once the first time: nothing recorded)
                    finished.append(time.perf_counter())
                    graph.replay()
                    done.record()
                times = [b - a for a, b in zip(finished[3:], finished[4:])]
            else:
                for _ in range(repeats + 3):
                    start = time.perf_counter()
                    attention.plan(key, cu_cpu, for_graph=True)
                    graph.replay()
                    stream.synchronize()
                    times.append(time.perf_counter() - start)
                times = times[3:]
            stream.synchronize()
            del graph
            attention.release(key)
        times.sort()
        return times[len(times) // 2] * 1e3

    @property
    def counters(self) -> GraphCounters:
        """Eager runs, captures, replays and evictions so far."""
        return self._counters

    def synchronize(self) -> None:
        """Wait for all queued device work (benchmarks)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
