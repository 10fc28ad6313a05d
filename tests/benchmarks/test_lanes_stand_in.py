"""`benchmarks.lanes_e2e --stand-in`: the lanes through `fern serve` itself, its forward pass a stand-in ready after a set time."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from benchmarks import lanes_e2e
from benchmarks.server import start_sidecar
from sidecar.client import FernClient
from sidecar.scheduler.config import SchedulerConfig

STAND_IN = ("-m", "tools.profiling.stand_in", "--engine-us", "20000", "--engine-ns-per-token", "0")


def test_the_stand_in_is_fern_serve_with_steps_ready_after_the_set_time(tmp_path):
    served = start_sidecar(None, device="cpu", extra=["--max-step-tokens", "8192"], log_dir=tmp_path,
                           launcher=STAND_IN)
    try:
        with FernClient(served.target, timeout=60) as client:
            assert client.model().name == "all-MiniLM-L6-v2"  # the real registry, doors and gateway
            started = time.perf_counter()
            out = client.embed(["a query about ferns"])
            took = time.perf_counter() - started
            # The stand-in's rows are zeros; normalizing leaves them so, whatever the text.
            assert out.vectors.shape == (1, 384) and not np.any(out.vectors)
            assert out.token_counts[0] >= 6  # tokenized for real: [CLS] a query about fern(s) [SEP]
        assert took >= 0.020  # not answered before its step was "done"
    finally:
        served.stop()
    assert "fern: serving all-MiniLM-L6-v2" in served.log_path.read_text()


class _SlowFirstClient:
    """A client whose first query takes 25 ms and every later one about 1 ms."""

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, texts, lane):
        self.calls += 1
        time.sleep(0.025 if self.calls == 1 else 0.001)


def test_online_latency_from_schedule_counts_the_wait_of_a_query_held_back_by_a_slow_one():
    # 100 queries/s for 95 ms (ten queries): the second is due 10 ms in but goes only when the first is
    # answered, 25 ms in, so it waited at least 15 ms before it was sent.
    result = lanes_e2e._online(_SlowFirstClient(), ["q"] * 20, rate=100.0, seconds=0.095)
    sent, scheduled = result["latency"], result["from_schedule"]
    assert sent["n"] == scheduled["n"] == 10
    # Only queries sent late differ, each by how late it went: the second alone accounts for 15 ms.
    assert scheduled["mean_ms"] - sent["mean_ms"] >= 15.0 / 10 - 1e-3
    assert scheduled["p90_ms"] >= sent["p90_ms"]


def test_process_cpu_seconds_reads_a_process_s_cpu_time_from_proc():
    # This process spins for 0.3 s of its own CPU time (process_time counts CPU, not wall, so a
    # loaded machine only makes the spin take longer): /proc says about as much went by.
    before = lanes_e2e.process_cpu_seconds(os.getpid())
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    spent = lanes_e2e.process_cpu_seconds(os.getpid()) - before
    assert 0.2 <= spent <= time.process_time() - start + 0.1


@pytest.mark.slow
def test_lanes_e2e_with_a_stand_in_runs_every_phase_with_the_gpu_budgets_and_traces_each_query(tmp_path):
    out = tmp_path / "lanes.json"
    assert lanes_e2e.main(["--stand-in", "100,100", "--online-rate", "20", "--batch-clients", "1",
                           "--batch-texts", "8", "--seconds", "1", "--warmup-seconds", "0.5", "--rounds", "1",
                           "--trace", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    gpu = SchedulerConfig()
    assert "tools.profiling.traced --out" in result["server_command"]
    assert "--engine-us 100.0 --engine-ns-per-token 100.0 serve" in result["server_command"]
    assert f"--max-step-tokens {gpu.max_step_tokens} --online-step-tokens {gpu.online_step_tokens}" in \
        result["server_command"]
    assert result["device"] == "cpu, stand-in forward pass 100,100"
    assert result["complete"] is True  # each round's partial file is replaced by the whole run's
    (round_,) = result["rounds"]
    assert round_["online_alone"]["latency"]["n"] == 20 and round_["mixed"]["online"]["latency"]["n"] == 20
    assert round_["mixed"]["online"]["from_schedule"]["n"] == 20
    assert result["summary"]["online_mixed_p99_from_schedule_ms"] == [
        round_["mixed"]["online"]["from_schedule"]["p99_ms"]]
    assert round_["batch_alone"]["tokens_per_s"] > 0 and round_["mixed"]["batch"]["tokens_per_s"] > 0
    for window in (round_["batch_alone"], round_["mixed"]["batch"]):
        assert window["server_cpu_cores"] >= 0 and window["server_cpu_ms_per_m_tokens"] >= 0
    assert result["summary"]["batch_alone_server_cpu_ms_per_m_tokens"] == [
        round_["batch_alone"]["server_cpu_ms_per_m_tokens"]]
    # Every query was matched to the server's record of it, and its checkpoints come in order.
    for phase in ("round 0 online alone", "round 0 mixed"):
        traced = result["trace"][phase]
        assert traced["queries"] == traced["matched_of"] == 20
        stages = traced["stages_ms"]
        assert [name for name, _, _ in lanes_e2e.STAGES] == list(stages)
        assert all(stage["n"] == 20 for stage in stages.values()) and traced["out_of_order"] == 0
        # The stand-in's step is ready 100 µs after its launch: launched and delivered bracket it.
        assert stages["step"]["p50_ms"] >= 0.09
        assert traced["slowest_1pct_total_ms"] >= stages["grpc_in"]["p50_ms"]
