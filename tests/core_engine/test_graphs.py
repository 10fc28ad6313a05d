"""CUDA-graph bookkeeping on any machine: token/slot/length buckets, the lazy capture policy, the LRU bound."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from core_engine.graphs import Action, BucketConfig, CapturePolicy, GraphCache, GraphKey, key_for, prewarm_shapes


def test_token_buckets_round_up_to_64_then_256() -> None:
    b = BucketConfig()
    assert [b.tokens(n) for n in (0, 1, 63, 64, 65, 128, 1000, 1024)] == [64, 64, 64, 64, 128, 128, 1024, 1024]
    assert [b.tokens(n) for n in (1025, 1280, 1281, 51200, 51201)] == [1280, 1280, 1536, 51200, 51456]
    with pytest.raises(ValueError, match="num_tokens"):
        b.tokens(-1)


def test_slot_buckets_leave_one_slot_for_padding() -> None:
    b = BucketConfig()
    assert [b.slots(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [2, 4, 4, 8, 8, 16, 128]
    with pytest.raises(ValueError, match="num_seqs"):
        b.slots(0)


def test_seqlen_bound_is_a_power_of_two_within_the_token_bucket() -> None:
    b = BucketConfig()
    assert b.seqlen(1, 64) == 64
    assert b.seqlen(128, 128) == 128
    assert b.seqlen(129, 1024) == 256
    assert b.seqlen(300, 320) == 320  # never above the token bucket


def test_key_counts_padding_as_a_sequence() -> None:
    # 3 tokens pad to 64: the 61 padding tokens form the longest "sequence".
    assert key_for([3], BucketConfig()) == GraphKey(tokens=64, slots=2, max_seqlen=64)
    # 100 texts of 512 tokens: exactly 51200 tokens, no padding.
    assert key_for([512] * 100, BucketConfig()) == GraphKey(tokens=51200, slots=128, max_seqlen=512)
    # Two batches of different lengths that round alike share a graph.
    assert key_for([10, 20], BucketConfig()) == key_for([29, 1], BucketConfig())


def test_lazy_policy_runs_eager_then_captures_then_replays() -> None:
    p = CapturePolicy(max_graphs=4)
    k = GraphKey(64, 2, 64)
    assert [p.decide(k) for _ in range(1)] == [Action.EAGER]
    assert p.decide(k) is Action.CAPTURE
    assert p.captured(k) == []
    assert [p.decide(k) for _ in range(3)] == [Action.REPLAY] * 3
    assert p.counters.as_dict() == dict(eager_runs=1, captures=1, replays=3, evictions=0, uncacheable=0)


def test_peek_answers_as_decide_would_and_counts_nothing() -> None:
    p = CapturePolicy(max_graphs=1, eager_hits=1)
    a, b = GraphKey(64, 2, 64), GraphKey(128, 2, 128)
    for key in (a, a, a, b, b, a):  # eager, capture, replay; b evicts a; a starts over
        before = (p.counters.as_dict(), dict(p._seen), p.cached_keys())
        expected = p.peek(key)
        assert p.peek(key) is expected
        assert (p.counters.as_dict(), dict(p._seen), p.cached_keys()) == before
        assert p.decide(key) is expected
        if expected is Action.CAPTURE:
            p.captured(key)
    assert p.counters.as_dict() == dict(eager_runs=3, captures=2, replays=1, evictions=1, uncacheable=0)


def test_eager_hits_zero_captures_on_first_sight_and_two_waits_longer() -> None:
    k = GraphKey(128, 4, 128)
    assert CapturePolicy(eager_hits=0).decide(k) is Action.CAPTURE
    p = CapturePolicy(eager_hits=2)
    assert [p.decide(k) for _ in range(3)] == [Action.EAGER, Action.EAGER, Action.CAPTURE]


def test_lru_bound_evicts_the_least_recently_replayed() -> None:
    p = CapturePolicy(max_graphs=2, eager_hits=0)
    a, b, c = (GraphKey(64 * i, 2, 64) for i in (1, 2, 3))
    for k in (a, b):
        assert p.decide(k) is Action.CAPTURE
        p.captured(k)
    assert p.decide(a) is Action.REPLAY  # a is now more recent than b
    assert p.decide(c) is Action.CAPTURE
    assert p.captured(c) == [b]
    assert p.cached_keys() == [a, c]
    assert p.counters.evictions == 1
    # An evicted key starts over: it is captured again (eager_hits=0) rather than replayed.
    assert p.decide(b) is Action.CAPTURE


def test_zero_graphs_means_always_eager() -> None:
    p = CapturePolicy(max_graphs=0)
    k = GraphKey(64, 2, 64)
    assert {p.decide(k) for _ in range(5)} == {Action.EAGER}
    assert p.counters.eager_runs == 5


def test_failed_capture_falls_back_to_eager_for_good() -> None:
    p = CapturePolicy(max_graphs=4)
    k = GraphKey(64, 2, 64)
    p.decide(k)
    assert p.decide(k) is Action.CAPTURE
    p.capture_failed(k)
    assert {p.decide(k) for _ in range(3)} == {Action.EAGER}
    assert p.counters.captures == 0 and p.counters.eager_runs == 5


class _UncapturableGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU; it is never replayed (its capture fails)."""

    def replay(self) -> None:
        raise AssertionError("a graph whose capture failed was replayed")


class _FailingCapture:
    """Stands in for torch.cuda.graph: the step runs under it, then ending the capture raises,
    as it does for a kernel that cannot be captured."""

    def __init__(self, graph: _UncapturableGraph, **_: object) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_failed_capture_releases_what_was_made_for_the_graph_then_runs_eagerly(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _UncapturableGraph)
    monkeypatch.setattr(torch.cuda, "graph", _FailingCapture)
    events: list[object] = []

    def forward() -> torch.Tensor:
        events.append("forward")
        return torch.ones(2)

    cache = GraphCache(CapturePolicy(max_graphs=4, eager_hits=1), torch.device("cpu"), on_evict=events.append)
    k = GraphKey(64, 2, 64)
    actions = []
    for _ in range(4):
        action = cache.decide(k)
        actions.append(action)
        assert torch.equal(cache.run(k, action, forward, backend="cpu"), torch.ones(2))
    assert actions == [Action.EAGER, Action.CAPTURE, Action.EAGER, Action.EAGER]
    # The capture attempt, the key's graph resources released once, then every step eagerly.
    assert events == ["forward", "forward", k, "forward", "forward", "forward"]
    assert len(cache) == 0 and cache.backend_of(k) is None
    assert cache.policy.counters.as_dict() == dict(eager_runs=4, captures=0, replays=0, evictions=0,
                                                   uncacheable=0)


class _PlanOnlyWrapper:
    """Stands in for FlashInfer's ragged prefill wrapper where only planning matters."""

    def __init__(self, workspace: torch.Tensor, layout: str, *, backend: str, **graph_buffers: object) -> None:
        pass

    def plan(self, *args: object, **kwargs: object) -> None:
        pass


def test_flashinfer_release_keeps_eager_plans_and_waits_for_the_graph_wrappers_last_copy(monkeypatch) -> None:
    from core_engine.attention.flashinfer import FlashInferAttention
    from core_engine.attention.base import AttentionShape

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithRaggedKVCacheWrapper=_PlanOnlyWrapper))
    attention = FlashInferAttention(torch.device("cpu"), AttentionShape(2, 2, 64), causal=False,
                                    dtype=torch.float32, max_tokens=64)
    k = GraphKey(64, 2, 64)
    cu_seqlens = torch.tensor([0, 10, 64], dtype=torch.int32)
    graph_plan = attention.plan(k, cu_seqlens, for_graph=True)
    eager_plan = attention.plan(k, cu_seqlens, for_graph=False)
    waited: list[GraphKey] = []
    graph_plan.on.copied = types.SimpleNamespace(synchronize=lambda: waited.append(k))  # the CUDA event
    attention.release(k)  # as after a failed capture: the key runs eagerly from now on
    # The released wrapper's pinned buffer may be reused once it is freed: its last copy has run.
    assert waited == [k]
    assert not attention.holds(graph_plan) and attention.holds(eager_plan)
    assert attention.plan(k, cu_seqlens, for_graph=False).on is eager_plan.on
    attention.release(k)  # nothing left to release or wait for
    assert waited == [k]


def test_bad_policy_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="max_graphs"):
        CapturePolicy(max_graphs=-1)
    with pytest.raises(ValueError, match="eager_hits"):
        CapturePolicy(eager_hits=-1)


def test_attention_selector_routes_by_shape_class_and_keeps_a_graph_on_its_backend() -> None:
    from core_engine.attention.cpu import CpuAttention
    from core_engine.attention.select import AttentionSelector, shape_class

    class Recording(CpuAttention):
        def __init__(self, name: str) -> None:
            self.name = name
            self.planned: list[GraphKey] = []
            self.released: list[GraphKey] = []

        def plan(self, key: GraphKey, cu_seqlens_cpu, for_graph: bool) -> tuple:
            self.planned.append(key)
            return (key, len(self.planned))

        def holds(self, plan: tuple) -> bool:
            return plan[1] == len(self.planned)

        def use(self, plan: tuple) -> None:
            self.used = plan

        def release(self, key: GraphKey) -> None:
            self.released.append(key)

    a, b = Recording("a"), Recording("b")
    sel = AttentionSelector({"a": a, "b": b}, forced=None)
    sel.choices = {"small": "a", "large": "b"}
    small, large = GraphKey(128, 2, 128), GraphKey(8192, 32, 512)
    assert shape_class(small) == "small" and shape_class(large) == "large"
    assert sel.activate(small) == "a" and sel.name == "a"
    assert sel.activate(large) == "b" and sel.name == "b"
    # A graph captured with "a" replays with "a" even where the choice for its class moved on.
    assert sel.activate(large, captured="a") == "a"
    plan = sel.plan(large, None, for_graph=True)
    assert a.planned == [large] and b.planned == []
    assert (plan.backend, plan.for_graph) == ("a", True) and a.used == plan.state
    assert sel.holds(plan, "a", for_graph=True)
    assert not sel.holds(plan, "a", for_graph=False) and not sel.holds(plan, "b", for_graph=True)
    # A later plan on the same backend makes the first one stale; using it switches back to "a".
    sel.plan(small, None, for_graph=False, backend="b")
    assert sel.name == "b" and sel.holds(plan, "a", for_graph=True)
    sel.plan(small, None, for_graph=False, backend="a")
    assert not sel.holds(plan, "a", for_graph=True)
    sel.use(plan)
    assert sel.name == "a" and a.used == plan.state
    sel.release(large)
    assert a.released == [large] and b.released == [large]


def test_prewarm_lists_parse_and_queries_follow_the_model_limit() -> None:
    b = BucketConfig()
    assert prewarm_shapes("", 512, b) == prewarm_shapes("none", 512, b) == []
    assert prewarm_shapes("queries", 8192, b) == [(n, 1) for n in range(64, 513, 64)]
    assert prewarm_shapes("queries", 256, b) == [(64, 1), (128, 1), (192, 1), (256, 1)]
    assert prewarm_shapes("queries", 100, b) == [(64, 1), (100, 1)]
    assert prewarm_shapes(" 128x1, 512x32 ", 512, b) == [(128, 1), (512, 32)]
    assert prewarm_shapes("queries,256x4", 256, b)[-1] == (256, 4)


@pytest.mark.parametrize("text, message", [
    ("12y3", "'12y3' is not LENGTHxCOUNT"),
    ("x4", "'x4' is not LENGTHxCOUNT"),
    ("128x", "'128x' is not LENGTHxCOUNT"),
    ("600x1", "'600x1' needs 1 to 512 tokens"),
    ("0x1", "'0x1' needs 1 to 512 tokens"),
    ("128x0", "'128x0' needs 1 to 512 tokens per sequence .* at least one sequence"),
])
def test_bad_prewarm_items_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prewarm_shapes(f"queries,{text}", 512, BucketConfig())


def test_queries_prewarm_covers_every_single_text_up_to_512_tokens() -> None:
    """Whatever one query's length, its step's graph key is one the "queries" list captured."""
    b = BucketConfig()
    warmed = {key_for([length] * count, b) for length, count in prewarm_shapes("queries", 512, b)}
    assert len(warmed) == 8
    assert {key_for([n], b) for n in range(1, 513)} == warmed


def test_measured_choice_keeps_the_fastest_backend_per_shape_class() -> None:
    """`choose` times every candidate per class through the timer it is given; a failing one is left out."""
    from core_engine.attention.select import AttentionSelector

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    sel = AttentionSelector({"varlen": Named("varlen"), "flashinfer": Named("flashinfer")}, forced=None)
    calls: list[tuple[str, int, int, bool]] = []
    costs = {("small", "varlen"): 0.2, ("small", "flashinfer"): 0.3, ("large", "varlen"): 5.0,
             ("large", "flashinfer"): 4.0}

    def time_step(sequences, pipelined: bool) -> float:
        cls = "large" if pipelined else "small"
        calls.append((sel.choices[cls], len(sequences), len(sequences[0]), pipelined))
        return costs[cls, sel.choices[cls]]

    sel.choose(time_step, max_tokens=256, model="m")
    assert sel.choices == {"small": "varlen", "large": "flashinfer"}
    assert sel.measurements == {"small": {"varlen": 0.2, "flashinfer": 0.3},
                                "large": {"varlen": 5.0, "flashinfer": 4.0}}
    # A 128-token query serialized, then 8192 tokens of the model's longest sequences back to back.
    assert calls == [("varlen", 1, 128, False), ("flashinfer", 1, 128, False),
                     ("varlen", 32, 256, True), ("flashinfer", 32, 256, True)]

    def flashinfer_fails(sequences, pipelined: bool) -> float:
        if sel.choices["large" if pipelined else "small"] == "flashinfer":
            raise RuntimeError("Invalid configuration")
        return 1.0

    sel.choose(flashinfer_fails, max_tokens=256, model="m")
    assert sel.choices == {"small": "varlen", "large": "varlen"}
    with pytest.raises(RuntimeError, match="no attention backend ran model 'm'"):
        sel.choose(lambda sequences, pipelined: (_ for _ in ()).throw(RuntimeError("x")), max_tokens=256, model="m")
    forced = AttentionSelector({"varlen": Named("varlen"), "flashinfer": Named("flashinfer")}, forced="flashinfer")
    forced.choose(lambda sequences, pipelined: pytest.fail("a forced backend is not measured"), 256, "m")
    assert forced.choices == {"small": "flashinfer", "large": "flashinfer"}
