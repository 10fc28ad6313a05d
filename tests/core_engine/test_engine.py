"""Engine on the CPU: defaults, packing layout, vectors against sentence-transformers, batch composition,
attention planned when a batch is prepared, errors."""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from core_engine.attention.base import AttentionMetadata
from core_engine.attention.cpu import CpuAttention
from core_engine import engine as engine_module
from core_engine.engine import Engine, PreparedBatch
from core_engine.graphs import Action, BucketConfig, CapturePolicy, GraphCache, GraphKey
from core_engine.settings import EngineConfig

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。 Привет, мир! 😀",
    "def add(a, b):\n    return a + b\n",
    "Fern packs sequences end to end without padding. " * 30,  # past 256 tokens: truncated
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def padded_engine() -> Engine:
    # The CUDA packing (token buckets, slot buckets, a padding slot) exercised on the CPU.
    return Engine(pad_to_buckets=True)


@pytest.fixture(scope="module")
def token_ids(engine: Engine) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.spec.tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(engine.spec.max_tokens)
    return [e.ids for e in tok.encode_batch(TEXTS)]


@pytest.fixture(scope="module")
def reference(engine: Engine) -> np.ndarray:
    """sentence-transformers' raw pooled vectors (Transformer + Pooling, Normalize left out)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(engine.spec.path), device="cpu")
    raw = SentenceTransformer(modules=[st[0], st[1]], device="cpu")
    raw.max_seq_length = engine.spec.max_tokens
    return raw.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_defaults_are_the_bundled_model_on_cpu_in_fp32(engine: Engine) -> None:
    assert engine.spec.name == "all-MiniLM-L6-v2"
    assert engine.spec.dimensions == 384
    assert engine.device == torch.device("cpu")
    assert engine.dtype == torch.float32
    assert engine.attention.name == "cpu"


def test_vectors_match_sentence_transformers(engine: Engine, token_ids: list[list[int]],
                                             reference: np.ndarray) -> None:
    vectors = engine.embed(token_ids)
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 384)
    assert np.all(_cosine(vectors, reference) >= 0.99999)
    # Raw pooled, not normalized: the norms agree with the reference's too.
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)


def test_batch_composition_and_bucket_padding_do_not_change_vectors(
        engine: Engine, padded_engine: Engine, token_ids: list[list[int]]) -> None:
    together = engine.embed(token_ids)
    alone = np.stack([engine.embed([ids])[0] for ids in token_ids])
    shuffled = engine.embed(token_ids[::-1])[::-1]
    padded = padded_engine.embed(token_ids)
    padded_alone = padded_engine.embed([token_ids[2]])
    for other in (alone, shuffled, padded):
        np.testing.assert_allclose(other, together, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(padded_alone[0], together[2], atol=2e-5, rtol=1e-4)


def test_prepare_packs_tokens_positions_and_slots(engine: Engine) -> None:
    batch = engine.prepare([[101, 7, 102], [101, 8, 9, 10, 102]])
    assert isinstance(batch, PreparedBatch)
    assert batch.key == GraphKey(tokens=8, slots=2, max_seqlen=5)
    assert batch.input_ids.tolist() == [101, 7, 102, 101, 8, 9, 10, 102]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert batch.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 8]
    assert batch.seq_lens.tolist() == [3, 5]
    assert batch.cu_seqlens_cpu.dtype == torch.int32


def test_padded_prepare_puts_padding_in_the_last_slot(padded_engine: Engine) -> None:
    batch = padded_engine.prepare([[101, 7, 102], [101, 8, 9, 10, 102]])
    assert batch.key == GraphKey(tokens=64, slots=4, max_seqlen=64)
    assert batch.num_seqs == 2 and batch.num_tokens == 8
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 8, 64]  # slot 2 empty, slot 3 = 56 padding tokens
    assert batch.seq_lens.tolist() == [3, 5, 0, 56]
    assert batch.seq_ids[8:].tolist() == [3] * 56
    assert batch.positions[8:].tolist() == list(range(56))
    assert batch.input_ids[8:].tolist() == [0] * 56


def test_packing_positions_beyond_the_engines_range(padded_engine: Engine, monkeypatch) -> None:
    """Positions are slices of the engine's 0, 1, 2, ... range, or a range of their own where it is short."""
    monkeypatch.setattr(padded_engine, "_ramp", np.arange(4, dtype=np.int64))
    batch = padded_engine.prepare([[101, 5, 6, 7, 8, 102], [101, 9, 102]])
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2] + list(range(55))


def test_prewarm_fails_before_the_weights_load_and_is_skipped_without_graphs(monkeypatch) -> None:
    engine = Engine(device="cpu", prewarm="queries,256x2")
    assert engine.prewarm == [] and engine.counters.eager_runs == 0  # the CPU keeps no graphs

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(engine_module, "build_model", no_weights)
    with pytest.raises(ValueError, match="prewarm: '300x1' needs 1 to 256 tokens"):
        Engine(device="cpu", prewarm="300x1")
    with pytest.raises(ValueError, match=r"prewarm: 256x20 \(5120 tokens\) does not fit the static buffers .*"
                                         r"\(max_step_tokens 2048\)"):
        Engine(device="cpu", prewarm="256x8,256x20", max_step_tokens=2048)


def test_engine_config_with_keyword_overrides_and_fern_switches(monkeypatch) -> None:
    """Keywords override `config`'s fields; without a config the FERN_* switches apply, with one they do not."""
    monkeypatch.setenv("FERN_GELU_EPILOGUE", "0")
    from_env = Engine(device="cpu", max_graphs=7)
    assert from_env.config.kernels.gelu_epilogue is False and from_env.config.max_graphs == 7
    assert all(layer.mlp.gelu_epilogue is False for layer in from_env.model.layers)

    config = EngineConfig(device="cpu", eager_hits=3, buckets=BucketConfig(small_step=32))
    given = Engine(config=config, eager_hits=2)
    assert given.config == config.replace(eager_hits=2) and given.policy.eager_hits == 2
    assert given.buckets.small_step == 32
    assert all(layer.mlp.gelu_epilogue is True for layer in given.model.layers)
    np.testing.assert_allclose(given.embed([[101, 7592, 102]]), from_env.embed([[101, 7592, 102]]),
                               rtol=1e-5, atol=1e-5)  # on the CPU the epilogue switch changes nothing
    with pytest.raises(RuntimeError, match="time_step replays CUDA graphs; this engine runs on cpu"):
        given.time_step([[101, 102]])


def test_step_returns_a_finished_handle_on_cpu(engine: Engine, token_ids: list[list[int]]) -> None:
    before = engine.counters.eager_runs
    handle = engine.step(engine.prepare(token_ids[:2]))
    assert handle.done()
    assert handle.rows == 2
    assert handle.result().shape == (2, 384)
    assert engine.counters.eager_runs == before + 1


def test_bad_inputs_name_the_sequence(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty batch"):
        engine.prepare([])
    with pytest.raises(ValueError, match=r"sequences\[1\]: 0 tokens"):
        engine.prepare([[101, 102], []])
    with pytest.raises(ValueError, match=r"sequences\[0\]: 257 tokens"):
        engine.prepare([[5] * 257])


def test_bad_engine_options_are_named() -> None:
    with pytest.raises(ValueError, match="dtype 'fp64'"):
        Engine(dtype="fp64")
    with pytest.raises(ValueError, match="device 'tpu:0'"):
        Engine(device="tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Engine(device="cuda")
        with pytest.raises(ValueError, match="attention 'varlen' needs a CUDA device"):
            Engine(attention="varlen")
    with pytest.raises(ValueError, match="attention backend 'nope' is unknown"):
        Engine(attention="nope")


@pytest.mark.slow
def test_compiled_forward_gives_the_same_vectors(tmp_path, monkeypatch) -> None:
    """The torch.compile path (attention outside the compiled regions) on the CPU, through
    aot_eager so no C++ toolchain is needed; on CUDA the default inductor backend runs."""
    from benchmarks.models import build_random_model

    monkeypatch.setenv("FERN_COMPILE_BACKEND", "aot_eager")
    model = build_random_model("bert", tmp_path / "bert", seed=3)
    plain = Engine(model, compile=False, pad_to_buckets=True)
    compiled = Engine(model, compile=True, pad_to_buckets=True)
    assert compiled.compiled and not plain.compiled
    # The compiled model's attention is a graph break (torch.compile never traces it); the
    # plain engine's is an ordinary call, so building it never needed torch._dynamo.
    assert getattr(type(compiled.attention).__call__, "_torchdynamo_disable", False)
    assert not hasattr(type(plain.attention).__call__, "_torchdynamo_disable")
    rng = np.random.default_rng(0)
    for lengths in ([5, 40, 130], [7]):
        seqs = [[101, *rng.integers(1000, 30000, size=n - 2).tolist(), 102] for n in lengths]
        np.testing.assert_allclose(compiled.embed(seqs), plain.embed(seqs), atol=1e-5, rtol=1e-5)


def test_an_engine_that_does_not_compile_never_imports_torch_dynamo() -> None:
    """Importing torch._dynamo costs ~1.1 s of start-up on the 2-core machine; the CPU engine needs none of it."""
    import subprocess

    code = ("import sys; from core_engine.engine import Engine; e = Engine(); e.embed([[101, 2000, 102]]); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


# -- attention planned when a batch is prepared (FlashInfer's plan, with a stand-in on the CPU) ----

@dataclass
class PlanLog:
    """Where each plan of the stand-in wrappers was made: in "prepare", in "step", or elsewhere (None)."""

    phase: str | None = None
    plans: list[str | None] = field(default_factory=list)


class FakePrefillWrapper:
    """Stands in for FlashInfer's BatchPrefillWithRaggedKVCacheWrapper on the CPU.

    Like the real wrapper, run() computes with its last plan, not with the batch it is given:
    it attends within the sequence boundaries it was last planned for. A batch run on another
    batch's plan gives wrong vectors. Graph-mode wrappers keep FlashInfer's rules: a fixed
    slot count, never more rows than at the first plan.
    """

    def __init__(self, log: PlanLog, float_workspace_buffer: torch.Tensor, kv_layout: str, *, backend: str,
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 kv_indptr_buf: torch.Tensor | None = None) -> None:
        self.log = log
        self.slots = len(qo_indptr_buf) - 1 if use_cuda_graph else None
        self.max_rows: int | None = None
        self.indptr: torch.Tensor | None = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, *, causal: bool, q_data_type: torch.dtype, kv_data_type: torch.dtype) -> None:
        assert torch.equal(qo_indptr, kv_indptr) and qo_indptr.dtype == torch.int32
        rows = int(qo_indptr[-1])
        if self.slots is not None:
            assert len(qo_indptr) - 1 == self.slots
            self.max_rows = self.max_rows or rows
            assert rows <= self.max_rows
        self.indptr = qo_indptr.clone()
        self.causal = causal
        self.log.plans.append(self.log.phase)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata(cu_seqlens=self.indptr, max_seqlen=0, seq_ids=None, seq_lens=None,
                                 causal=self.causal, cu_seqlens_cpu=self.indptr)
        return CpuAttention()(q, k, v, meta)


class GraphsOnCpu(GraphCache):
    """The graph cache's bookkeeping without CUDA: a capture notes the FlashInfer wrapper its step ran
    with, a replay runs the step again on that wrapper (a replayed graph runs the wrapper recorded in
    it, whatever was made active since)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.policy, engine.device, on_evict=engine.attention.release)
        self.flashinfer = engine.attention.candidates["fake-flashinfer"]
        self.recorded: dict[GraphKey, tuple[str, object]] = {}
        self.actions: list[Action] = []

    def backend_of(self, key: GraphKey) -> str | None:
        return self.recorded[key][0] if key in self.recorded else None

    def run(self, key, action, forward, backend):
        self.actions.append(action)
        if action is Action.REPLAY:
            self.flashinfer._active = self.recorded[key][1]
            return forward()
        out = forward()
        if action is Action.CAPTURE:
            self.recorded[key] = (backend, self.flashinfer._active)
            for old in self.policy.captured(key):
                del self.recorded[old]
                self.on_evict(old)
        return out


def _planning_engine(monkeypatch: pytest.MonkeyPatch, max_graphs: int, eager_hits: int = 1) -> tuple[Engine, PlanLog]:
    """A padded CPU engine whose attention is FlashInferAttention over the stand-in wrapper, with graphs."""
    from core_engine import attention
    from core_engine.attention.flashinfer import FlashInferAttention
    from core_engine.attention.base import AttentionShape

    log = PlanLog()
    fake = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=functools.partial(FakePrefillWrapper, log))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(attention._FACTORIES, "fake-flashinfer", lambda **_: FlashInferAttention(
        torch.device("cpu"), AttentionShape(12, 12, 32), causal=False, dtype=torch.float32, max_tokens=1024))
    engine = Engine(attention="fake-flashinfer", pad_to_buckets=True)
    engine.policy.max_graphs, engine.policy.eager_hits = max_graphs, eager_hits
    engine._runner.graphs = GraphsOnCpu(engine)

    def phased(call, phase):
        def run(*args):
            log.phase = phase
            try:
                return call(*args)
            finally:
                log.phase = None
        return run

    engine.prepare, engine.step = phased(engine.prepare, "prepare"), phased(engine.step, "step")
    return engine, log


@dataclass
class Step:
    sequences: list[list[int]]
    jump: list[list[int]] | None = None     # online work launched (prepared and stepped) just before this step
    dropped: list[list[int]] | None = None  # a step prepared after this one, then dropped


def _serve(engine: Engine, steps: list[Step]) -> list[tuple[list[list[int]], np.ndarray]]:
    """Launch `steps` as sidecar.scheduler.pipeline.Pipeline._work does: prepare N+1 while N runs, collect N, launch
    the jump step if any (prepare + step), then N+1. Returns (sequences, vectors) in launch order."""
    launched: list[tuple[list[list[int]], np.ndarray]] = []
    in_flight: list = []
    for step in steps:
        prepared = engine.prepare(step.sequences)
        if step.dropped is not None:
            engine.prepare(step.dropped)
        launched += [(seqs, handle.result()) for seqs, handle in in_flight]
        in_flight = []
        if step.jump is not None:
            in_flight.append((step.jump, engine.step(engine.prepare(step.jump))))
        in_flight.append((step.sequences, engine.step(prepared)))
    launched += [(seqs, handle.result()) for seqs, handle in in_flight]
    return launched


def _seqs(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[101, *rng.integers(1000, 30000, size=n - 2).tolist(), 102] for n in lengths]


# Graph keys (padded to buckets): A (64 tokens, 4 slots), B (128, 2), C (128, 4), J (64, 8).
A = [_seqs(i, lengths) for i, lengths in enumerate([[20, 30], [30, 20], [10, 45], [40, 15], [25, 25], [33, 22]])]
B = [_seqs(10 + i, [n]) for i, n in enumerate([100, 90, 120])]
C = _seqs(20, [40, 40, 40])
J = _seqs(21, [5, 6, 7, 8])


def _check(engine: Engine, reference: Engine, launched, max_graphs: int) -> None:
    """Every batch's vectors are its own (against the plain CPU engine) and the capture policy counted
    exactly what it counts for these steps in launch order when nothing is planned ahead."""
    for seqs, vectors in launched:
        np.testing.assert_allclose(vectors, reference.embed(seqs), atol=2e-5, rtol=1e-4)
    policy = CapturePolicy(max_graphs=max_graphs, eager_hits=engine.policy.eager_hits)
    for seqs, _ in launched:
        if policy.decide(engine.prepare(seqs).key) is Action.CAPTURE:
            policy.captured(engine.prepare(seqs).key)
    assert engine.counters.as_dict() == policy.counters.as_dict()


def test_fixture_keys_are_as_the_scenarios_need(padded_engine: Engine) -> None:
    keys = {name: {padded_engine.prepare(s).key for s in group} for name, group in
            dict(A=A, B=B, C=[C], J=[J]).items()}
    assert all(len(k) == 1 for k in keys.values()) and len(set.union(*keys.values())) == 4


def test_attention_is_planned_when_prepared_and_not_again_when_stepped(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=4)
    launched = _serve(planning, [Step(A[0]), Step(A[1]), Step(A[2]), Step(B[0]), Step(A[3])])
    assert planning.graphs.actions == [Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.EAGER, Action.REPLAY]
    assert log.plans == ["prepare"] * 5
    _check(planning, engine, launched, max_graphs=4)


def test_a_jump_step_launched_in_between_makes_the_step_plan_again_only_on_a_shared_wrapper(
        engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=4)
    launched = _serve(planning, [
        Step(A[0]), Step(A[1]),       # A: eager, capture
        Step(A[2], jump=A[3]),        # the jump replays A's graph on A's wrapper: A[2] plans again
        Step(A[4], jump=J),           # the jump runs eagerly on the eager wrapper: A[4]'s graph plan holds
        Step(B[0], jump=C),           # both eager, on the one eager wrapper: B[0] plans again
    ])
    assert [seqs for seqs, _ in launched] == [A[0], A[1], A[3], A[2], J, A[4], C, B[0]]
    assert planning.graphs.actions == [Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.REPLAY,
                                       Action.EAGER, Action.REPLAY, Action.EAGER, Action.EAGER]
    P = "prepare"
    assert log.plans == [P, P, P, P, "step", P, P, P, P, "step"]
    _check(planning, engine, launched, max_graphs=4)


def test_a_jump_step_that_captures_the_key_makes_the_step_plan_again(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=4)
    # A[1] is prepared expecting A's capture on A's wrapper; the jump (same key) captures it first,
    # so A[1] replays, on the same wrapper, which the jump planned last.
    launched = _serve(planning, [Step(A[0]), Step(A[1], jump=A[2]), Step(A[3])])
    assert planning.graphs.actions == [Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.REPLAY]
    assert log.plans == ["prepare", "prepare", "prepare", "step", "prepare"]
    _check(planning, engine, launched, max_graphs=4)


def test_a_step_runs_its_own_plan_though_another_wrapper_was_planned_after_it(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=4)
    launched = _serve(planning, [
        Step(A[0]),
        Step(A[1], jump=J),           # A's capture must record A's wrapper, not the jump's eager one
        Step(A[2]),                   # so that this replay computes A[2]
        Step(B[0], dropped=A[3]),     # B[0] runs on the eager wrapper, not on A's, planned after it
    ])
    assert planning.graphs.actions == [Action.EAGER, Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.EAGER]
    assert log.plans == ["prepare"] * 6
    _check(planning, engine, launched, max_graphs=4)


def test_a_prepared_batch_that_is_dropped_makes_the_next_step_plan_again(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=4)
    launched = _serve(planning, [
        Step(A[0], dropped=B[0]),     # eager wrapper, planned for B[0] after A[0]
        Step(A[1]),                   # capture
        Step(A[2], dropped=A[3]),     # A's graph wrapper, planned for A[3] after A[2]
        Step(A[4], dropped=B[1]),     # B[1] plans the eager wrapper: A[4]'s graph plan holds
    ])
    assert planning.graphs.actions == [Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.REPLAY]
    P = "prepare"
    assert log.plans == [P, P, "step", P, P, P, "step", P, P]
    _check(planning, engine, launched, max_graphs=4)


def test_an_eviction_in_between_makes_the_step_plan_again_on_the_new_wrapper(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=1)
    flashinfer = planning.attention.candidates["fake-flashinfer"]
    launched = _serve(planning, [
        Step(A[0]), Step(B[0]), Step(A[1]),   # A eager, B eager, A captured
        Step(A[2], jump=B[1]),                # the jump captures B, evicting A: A[2] runs eagerly
        Step(A[3]), Step(A[4]), Step(A[5]),   # A captured again (on a new wrapper; B evicted), replayed
    ])
    assert planning.graphs.actions == [Action.EAGER, Action.EAGER, Action.CAPTURE, Action.CAPTURE, Action.EAGER,
                                       Action.CAPTURE, Action.REPLAY, Action.REPLAY]
    assert planning.counters.evictions == 2
    assert list(flashinfer._graph_wrappers) == [planning.prepare(A[0]).key]
    assert log.plans.count("step") == 1
    _check(planning, engine, launched, max_graphs=1)


def test_a_graph_key_evicted_and_captured_again_runs_on_its_new_wrapper(engine: Engine, monkeypatch) -> None:
    planning, log = _planning_engine(monkeypatch, max_graphs=1, eager_hits=0)
    launched = _serve(planning, [
        Step(A[0]),                   # captured at once (eager_hits=0)
        Step(A[1], jump=B[0]),        # prepared to replay on A's wrapper; the jump's capture evicts A,
                                      # so A[1] captures A again, on a new wrapper
        Step(A[2]),                   # replays that graph: the new wrapper holds A[2]'s plan
    ])
    assert planning.graphs.actions == [Action.CAPTURE, Action.CAPTURE, Action.CAPTURE, Action.REPLAY]
    assert log.plans == ["prepare", "prepare", "prepare", "step", "prepare"]
    _check(planning, engine, launched, max_graphs=1)


@pytest.mark.parametrize("capability, head_dim, kernel", [
    ((9, 0), 64, "fa3"), ((9, 0), 128, "fa3"), ((9, 0), 96, "fa2"), ((8, 0), 64, "fa2"), ((10, 0), 128, "fa2"),
])
def test_flashinfer_kernel_is_fa3_only_on_hopper_head_dims_it_compiles(monkeypatch, capability, head_dim, kernel):
    from core_engine.attention.flashinfer import default_kernel
    from core_engine.attention.base import AttentionShape

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert default_kernel(torch.device("cuda", 0), AttentionShape(16, 16, head_dim)) == kernel
    assert default_kernel(torch.device("cpu"), AttentionShape(16, 16, head_dim)) == "fa2"  # the CPU stand-in


def test_startup_is_broken_down_and_adds_up(engine):
    parts = engine.startup_seconds
    assert set(parts) == {"attention", "weights", "compile", "choose_attention", "prewarm"}
    assert all(v >= 0 for v in parts.values()) and parts["weights"] > 0
    assert abs(sum(parts.values()) - engine.load_seconds) <= 0.01  # nothing left out


def test_replays_tells_a_graph_replay_from_an_eager_step_or_a_capture_and_counts_nothing(engine, monkeypatch):
    # The scheduler launches a query's step from the event loop only when it is a replay.
    assert not engine.replays(engine.prepare(A[0]))  # the CPU engine keeps no graphs
    planning, _ = _planning_engine(monkeypatch, max_graphs=4)
    expected_actions = [Action.EAGER, Action.CAPTURE, Action.REPLAY]
    for seqs, action in zip(A, expected_actions):
        batch = planning.prepare(seqs)
        counters = planning.counters.as_dict()
        assert planning.replays(batch) is (action is Action.REPLAY)
        assert planning.counters.as_dict() == counters
        planning.step(batch).result()
        assert planning.graphs.actions[-1] is action
    assert planning.replays(planning.prepare(A[3]))
    assert not planning.replays(planning.prepare(B[0]))  # another key: not captured
