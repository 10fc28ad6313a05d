"""The adapters' progress bar: what a terminal shows, and nothing where stderr is not one."""

from __future__ import annotations

import io

from adapters.progress import Progress


def test_a_known_total_shows_the_share_done_and_ends_its_line():
    out = io.StringIO()
    bar = Progress("ingest docs", total=200, stream=out, enabled=True, interval=0)
    bar.update(50)
    assert "ingest docs: 50/200 rows |#####" in out.getvalue() and " 25% " in out.getvalue()
    bar.close(200)
    assert "200/200" in out.getvalue() and out.getvalue().endswith("\n")


def test_a_queue_depth_moves_the_total_and_a_closed_bar_starts_anew():
    out = io.StringIO()
    bar = Progress("fern worker", stream=out, enabled=True, interval=0)
    bar.advance(10, remaining=90)
    assert "fern worker: 10/100 rows" in out.getvalue()
    bar.advance(10, remaining=30)  # rows arrived in the queue meanwhile, or were claimed by others
    assert "20/50" in out.getvalue()
    bar.close()
    bar.advance(5)  # after a reconnect the count goes on
    assert "fern worker: 25 rows" in out.getvalue()
    bar.close()
    assert out.getvalue().count("\n") == 2 and bar.done == 25


def test_nothing_is_drawn_off_a_terminal():
    quiet = io.StringIO()
    bar = Progress("x", stream=quiet)
    bar.update(5)
    bar.close(9)
    assert quiet.getvalue() == "" and bar.done == 9
