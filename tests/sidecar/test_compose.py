"""Step composition as a pure function: lanes, budget and `now` in; the step and the expired requests out."""

from __future__ import annotations

from itertools import accumulate, count

import numpy as np

from sidecar.lanes import Lane, LaneQueue, Request
from sidecar.scheduler.compose import Composed, compose, compose_online
from sidecar.scheduler.config import SchedulerConfig

CONFIG = SchedulerConfig(
    max_step_tokens=64,
    online_step_tokens=32,
    max_step_sequences=16,
    max_queued_tokens_online=10_000,
    max_queued_tokens_batch=10_000,
)
NOW = 100.0
_ids = count(1)


def request(lane: Lane, *lengths: int, deadline: float | None = None) -> Request:
    """A request of sequences of `lengths` tokens; every token id is unique, so steps are checkable."""
    sequences = [[next(_ids) for _ in range(n)] for n in lengths]
    return Request(
        lane=lane,
        sequences=sequences,
        offsets=list(accumulate(lengths, initial=0)),
        deadline=deadline,
        out=np.empty((len(sequences), 1), dtype=np.float32),
        remaining=len(sequences),
    )


def lanes(*requests: Request, config: SchedulerConfig = CONFIG) -> dict[Lane, LaneQueue]:
    """Both lanes, with `requests` queued in order."""
    queues = {lane: LaneQueue(lane, config.bound(lane)) for lane in Lane}
    for r in requests:
        queues[r.lane].push(r)
    return queues


def spans(composed: Composed) -> list[tuple[Request, int, int]]:
    """The step's chunks as (request, start, end)."""
    assert composed.step is not None
    return [(c.request, c.start, c.end) for c in composed.step.chunks]


def test_nothing_queued_composes_nothing():
    assert compose(lanes(), CONFIG, NOW) == Composed(None, [])


def test_online_goes_ahead_of_batch_queued_before_it():
    batch = request(Lane.BATCH, 4, 4)
    online = request(Lane.ONLINE, 3)
    composed = compose(lanes(batch, online), CONFIG, NOW)
    assert spans(composed) == [(online, 0, 1), (batch, 0, 2)]
    assert composed.step.sequences == online.sequences + batch.sequences
    assert composed.step.tokens == 11
    assert composed.expired == []


def test_first_come_first_served_within_a_lane():
    first, second, third = (request(Lane.BATCH, 5) for _ in range(3))
    composed = compose(lanes(first, second, third), CONFIG, NOW)
    assert [r for r, _, _ in spans(composed)] == [first, second, third]


def test_a_batch_step_fills_max_step_tokens_and_splits_the_request_that_does_not_fit():
    big = request(Lane.BATCH, *[10] * 10)  # 100 tokens
    queues = lanes(big)
    composed = compose(queues, CONFIG, NOW)
    assert spans(composed) == [(big, 0, 6)]  # 60 tokens; a seventh would make 70 > 64
    assert composed.step.tokens == 60
    assert queues[Lane.BATCH].tokens == 40
    again = compose(queues, CONFIG, NOW)  # the rest comes next, from where the split was
    assert spans(again) == [(big, 6, 10)]


def test_a_request_behind_one_that_did_not_fit_waits_its_turn():
    first = request(Lane.BATCH, 60)
    second = request(Lane.BATCH, 10)  # would fit on its own, but FCFS: not past the first's split
    third = request(Lane.BATCH, 2)
    composed = compose(lanes(first, second, third), CONFIG, NOW)
    assert spans(composed) == [(first, 0, 1)]


def test_a_step_with_online_work_is_capped_at_online_step_tokens():
    online = request(Lane.ONLINE, 20)
    batch = request(Lane.BATCH, *[4] * 10)
    composed = compose(lanes(online, batch), CONFIG, NOW)
    assert spans(composed) == [(online, 0, 1), (batch, 0, 3)]  # 20 + 12 = 32
    assert composed.step.tokens == CONFIG.online_step_tokens


def test_online_alone_may_use_the_whole_step_budget_and_leaves_no_batch_fill():
    online = [request(Lane.ONLINE, 10) for _ in range(5)]  # 50 tokens > online_step_tokens
    batch = request(Lane.BATCH, 1)
    queues = lanes(*online, batch)
    composed = compose(queues, CONFIG, NOW)
    assert [r for r, _, _ in spans(composed)] == online
    assert composed.step.tokens == 50
    assert queues[Lane.BATCH].tokens == 1  # still queued


def test_online_beyond_max_step_tokens_waits_for_the_next_step():
    online = [request(Lane.ONLINE, 30) for _ in range(3)]
    queues = lanes(*online)
    assert [r for r, _, _ in spans(compose(queues, CONFIG, NOW))] == online[:2]
    assert [r for r, _, _ in spans(compose(queues, CONFIG, NOW))] == online[2:]


def test_a_sequence_longer_than_the_budget_runs_alone_but_never_as_batch_fill():
    long = request(Lane.BATCH, 100)
    assert spans(compose(lanes(long), CONFIG, NOW)) == [(long, 0, 1)]

    online = request(Lane.ONLINE, 2)
    long = request(Lane.BATCH, 100)
    queues = lanes(online, long)
    assert spans(compose(queues, CONFIG, NOW)) == [(online, 0, 1)]
    assert spans(compose(queues, CONFIG, NOW)) == [(long, 0, 1)]  # alone, once no online work is left


def test_both_lanes_share_the_sequence_slots():
    online = request(Lane.ONLINE, *[1] * 10)
    batch = request(Lane.BATCH, *[1] * 10)
    composed = compose(lanes(online, batch), CONFIG, NOW)
    assert spans(composed) == [(online, 0, 10), (batch, 0, 6)]  # 16 = max_step_sequences
    assert len(composed.step.sequences) == CONFIG.max_step_sequences


def test_a_request_that_expired_in_its_queue_is_returned_as_expired_and_not_in_the_step():
    stale = request(Lane.BATCH, 4, deadline=NOW)  # a deadline at `now` has passed
    live = request(Lane.BATCH, 4, deadline=NOW + 1)
    stale_query = request(Lane.ONLINE, 4, deadline=NOW - 1)
    queues = lanes(stale, live, stale_query)
    composed = compose(queues, CONFIG, NOW)
    assert spans(composed) == [(live, 0, 1)]
    assert composed.expired == [stale_query, stale]  # ONLINE's first, as the lanes were taken
    assert queues[Lane.BATCH].tokens == 0 and queues[Lane.ONLINE].tokens == 0


def test_expired_requests_are_left_for_the_caller_to_mark():
    stale = request(Lane.ONLINE, 4, deadline=NOW)
    composed = compose(lanes(stale), CONFIG, NOW)
    assert composed == Composed(None, [stale])
    assert not stale.settled and not stale.dropped and stale.remaining == 1


def test_a_request_composed_before_its_deadline_runs():
    r = request(Lane.BATCH, 4, deadline=NOW)
    composed = compose(lanes(r), CONFIG, NOW - 0.001)
    assert spans(composed) == [(r, 0, 1)] and composed.expired == []


def test_a_dropped_request_is_skipped_and_not_reported_expired():
    cancelled = request(Lane.BATCH, 4, deadline=NOW - 1)
    kept = request(Lane.BATCH, 4)
    queues = lanes(cancelled, kept)
    cancelled.dropped = True
    queues[Lane.BATCH].drop(cancelled)
    composed = compose(queues, CONFIG, NOW)
    assert spans(composed) == [(kept, 0, 1)] and composed.expired == []


def test_compose_online_takes_online_work_only_within_its_budget():
    online = [request(Lane.ONLINE, 10) for _ in range(4)]
    queues = lanes(*online, request(Lane.BATCH, 1))
    composed = compose_online(queues[Lane.ONLINE], 32, CONFIG.max_step_sequences, NOW)
    assert [r for r, _, _ in spans(composed)] == online[:3]
    assert composed.step.tokens == 30
    assert queues[Lane.BATCH].tokens == 1


def test_compose_online_reports_expired_and_takes_an_oversize_query_alone():
    stale = request(Lane.ONLINE, 4, deadline=NOW)
    long = request(Lane.ONLINE, 50)
    composed = compose_online(lanes(stale, long)[Lane.ONLINE], 32, CONFIG.max_step_sequences, NOW)
    assert spans(composed) == [(long, 0, 1)] and composed.expired == [stale]
    assert compose_online(lanes()[Lane.ONLINE], 32, 16, NOW) == Composed(None, [])
