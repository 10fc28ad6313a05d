"""tools.profiling.startup on the CPU: each phase in a fresh interpreter, the engine's parts in its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.profiling.startup import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a phase that needs CUDA fails without it")
def test_startup_times_each_phase_in_a_fresh_process(tmp_path: Path) -> None:
    from core_engine.loader import default_model_dir

    out = tmp_path / "startup.json"
    assert main(["--model", str(default_model_dir()), "--device", "cpu", "--rounds", "2",
                 "--only", "read: loader", "engine", "cuda context", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m tools.profiling.startup --model")
    assert result["checkpoint_bytes"] > 0
    runs = result["runs"]
    assert [len(runs[name]) for name in ("read: loader", "engine", "cuda context")] == [2, 2, 2]
    assert all(r["tensors"] > 0 for r in runs["read: loader"])
    for run in runs["engine"]:
        parts = run["startup_seconds"]
        assert set(parts) == {"attention", "weights", "compile", "choose_attention", "prewarm"}
        assert run["since_start"] >= run["seconds"] > 0  # the imports came first, in the same process
    # A phase this machine cannot run is recorded with its error and left out of the medians.
    assert all("error" in r for r in runs["cuda context"])
    assert set(result["median_seconds"]) == {"read: loader", "engine"}
