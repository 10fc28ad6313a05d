"""SchedulerConfig: its defaults, per-device defaults, overrides and validation; no environment reads."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.lanes import Lane
from sidecar.scheduler import SchedulerConfig

GPU_DEFAULTS = dict(
    max_step_tokens=8192,
    online_step_tokens=2048,
    max_step_sequences=1024,
    max_queued_tokens_online=65_536,
    max_queued_tokens_batch=262_144,
    launch_on_arrival=True,
    online_poll_s=0.020,
)


def test_defaults_are_the_gpu_budgets_with_the_loop_launch_on():
    assert dataclasses.asdict(SchedulerConfig()) == GPU_DEFAULTS


def test_no_environment_variable_changes_a_default(monkeypatch):
    monkeypatch.setenv("FERN_LAUNCH_ON_ARRIVAL", "0")
    monkeypatch.setenv("FERN_ONLINE_POLL_MS", "0")
    config = SchedulerConfig()
    assert config.launch_on_arrival is True and config.online_poll_s == 0.020
    assert SchedulerConfig.for_device("cuda") == config


def test_for_device_cuda_is_the_defaults_and_cpu_scales_the_budgets_down():
    assert SchedulerConfig.for_device("cuda") == SchedulerConfig()
    cpu = SchedulerConfig.for_device("cpu")
    assert (cpu.max_step_tokens, cpu.online_step_tokens, cpu.max_step_sequences,
            cpu.max_queued_tokens_online, cpu.max_queued_tokens_batch) == (512, 128, 256, 16_384, 65_536)
    assert cpu.launch_on_arrival is True and cpu.online_poll_s == 0.020


def test_overrides_win_over_the_device_defaults():
    cpu = SchedulerConfig.for_device("cpu", max_step_tokens=1024, launch_on_arrival=False, online_poll_s=0.0)
    assert cpu.max_step_tokens == 1024
    assert cpu.online_step_tokens == 128  # the rest stay the CPU's
    assert cpu.launch_on_arrival is False and cpu.online_poll_s == 0.0
    gpu = SchedulerConfig.for_device("cuda", online_poll_s=0.005)
    assert gpu.online_poll_s == 0.005 and gpu.max_step_tokens == 8192


def test_for_device_rejects_an_unknown_field():
    with pytest.raises(TypeError, match="max_step_token"):
        SchedulerConfig.for_device("cpu", max_step_token=1)


@pytest.mark.parametrize("field", ["max_step_tokens", "online_step_tokens", "max_step_sequences",
                                   "max_queued_tokens_online", "max_queued_tokens_batch"])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_a_budget_that_is_not_a_positive_integer_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field} must be a positive integer"):
        SchedulerConfig(**{field: value})


def test_online_step_tokens_may_not_exceed_max_step_tokens():
    with pytest.raises(ValueError, match="online_step_tokens .4096. must not exceed max_step_tokens .2048."):
        SchedulerConfig(max_step_tokens=2048, online_step_tokens=4096)
    assert SchedulerConfig(max_step_tokens=2048, online_step_tokens=2048).online_step_tokens == 2048


def test_a_negative_online_poll_is_refused():
    with pytest.raises(ValueError, match="online_poll_s must be >= 0"):
        SchedulerConfig(online_poll_s=-0.001)
    with pytest.raises(ValueError, match="online_poll_s"):
        SchedulerConfig(online_poll_s=float("nan"))


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().max_step_tokens = 1  # type: ignore[misc]


def test_bound_is_each_lanes_queue_limit():
    config = SchedulerConfig(max_queued_tokens_online=100, max_queued_tokens_batch=200)
    assert (config.bound(Lane.ONLINE), config.bound(Lane.BATCH)) == (100, 200)


def test_every_name_imported_from_the_package_still_resolves():
    import sidecar.scheduler as scheduler

    for name in ("DEADLINE_SLACK_S", "DeadlineExceeded", "Draining", "EngineLike", "EngineStats", "Lane",
                 "LaneStats", "QueueFull", "Scheduler", "SchedulerConfig", "SchedulerStats"):
        assert hasattr(scheduler, name), name
    assert set(scheduler.__all__) <= set(dir(scheduler))
