"""tools.profiling.launch_path on the CPU: every piece of a small step's host path timed once a step, then unwrapped."""

from __future__ import annotations

import json
from pathlib import Path

from core_engine.engine import Engine
from core_engine.graphs import GraphCache
from tools.profiling.launch_path import main


def test_launch_path_times_each_piece_of_a_step_and_restores_the_engine(tmp_path: Path) -> None:
    from core_engine.loader import default_model_dir

    originals = (Engine.prepare, Engine.step, Engine._pack, GraphCache.run)
    out = tmp_path / "launch_path.json"
    assert main(["--model", str(default_model_dir()), "--device", "cpu", "--tokens", "12", "--iters", "30",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m tools.profiling.launch_path --model")
    run = result["launch_path"]
    assert (run["tokens"], run["iters"]) == (12, 30)
    pieces = run["pieces_us"]
    for name in ("prepare", "prepare: pack", "prepare: pack: pack_into", "replays", "step", "launch: graphs.run",
                 "host_total (prepare to launched)", "wait (launched to done)", "result()"):
        assert pieces[name]["calls_per_step"] == 1.0, name
        assert 0 < pieces[name]["p50_us"] <= pieces[name]["p99_us"], name
    # A piece includes what it calls, and the whole includes its pieces.
    assert pieces["prepare: pack"]["p50_us"] <= pieces["prepare"]["p50_us"]
    assert pieces["step"]["p50_us"] <= pieces["host_total (prepare to launched)"]["p50_us"]
    assert "gpu (step, CUDA events)" not in pieces  # no device time on the CPU
    assert (Engine.prepare, Engine.step, Engine._pack, GraphCache.run) == originals
