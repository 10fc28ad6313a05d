"""tools.profiling.collapsed: py-spy's raw recordings summed per thread and per innermost stack."""

from tools.profiling.collapsed import load, summary


def test_shares_per_thread_and_stack_with_paths_and_thread_ids_dropped(tmp_path):
    raw = tmp_path / "gil.txt"
    raw.write_text(
        "thread (101): MainThread;run (uvloop/__init__.py:92);Embed (sidecar/server.py:342) 6\n"
        "thread (101): MainThread;run (uvloop/__init__.py:92) 2\n"
        "thread (202): fern-engine-0;pack_into (core_engine/batch.py:75) 2\n")
    rows = load(str(raw))
    assert rows[0] == ("thread: MainThread", ["run (__init__.py:92)", "Embed (server.py:342)"], 6)
    text = summary(rows, depth=2, top=2)
    assert text.splitlines()[:3] == ["10 samples", " 80.0%  thread: MainThread", " 20.0%  thread: fern-engine-0"]
    assert " 60.0%  [thread: MainThread] Embed (server.py:342) <- run (__init__.py:92)" in text
    assert len(text.splitlines()) == 3 + 1 + 2
