"""An engine that compiles in the background: ready at once, uncompiled, then the compiled runner takes over.

On this machine the compiler is torch.compile with the "eager" backend (Dynamo traces the model
in the background thread; no C++ toolchain needed), which gives the same numbers as the
uncompiled model, so every vector is checked for equality with a plain engine's.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from core_engine.engine import Engine
from core_engine.settings import EngineConfig

SEQUENCES = [[101, 2023 + i, 2003, 1037, 3231, 102] for i in range(4)] + [[101, 7592, 102]]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return Engine(device="cpu").embed(SEQUENCES)


def background_engine(backend: str = "eager") -> Engine:
    return Engine(config=EngineConfig(device="cpu", compile=True, compile_backend=backend,
                                      compile_in_background=True))


def test_it_serves_before_the_compile_and_the_same_vectors_after(reference: np.ndarray) -> None:
    engine = background_engine()
    assert not engine.startup_seconds["compile"]  # nothing of the compile was waited for
    before = engine.embed(SEQUENCES)
    assert engine.wait_compiled(timeout=300)
    assert engine.compiled and not engine.compiling and engine.compile_error is None
    assert engine.compile_seconds > 0
    after = engine.embed(SEQUENCES)
    np.testing.assert_array_equal(before, reference)
    np.testing.assert_array_equal(after, reference)
    # One set of counters across both runners: every step so far, eager on the CPU.
    assert engine.counters.eager_runs == 2


def test_a_batch_prepared_before_the_switch_is_stepped_on_the_compiled_runner(reference: np.ndarray) -> None:
    engine = background_engine()
    uncompiled = engine._runner
    batch = engine.prepare(SEQUENCES)
    assert batch.runner is uncompiled
    engine._compiler.join(300)  # compiled and pending: the next step adopts it
    assert not engine.replays(batch)  # a pending runner is never the cheap path
    assert engine.compiled and engine._runner is uncompiled
    vectors = engine.step(batch).result()
    assert batch.runner is engine._runner is not uncompiled
    np.testing.assert_array_equal(vectors, reference)


def test_a_failed_background_compile_leaves_it_serving_uncompiled(reference: np.ndarray,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="core_engine.engine"):
        engine = background_engine(backend="no-such-backend")
        assert engine.wait_compiled(timeout=300)
    assert not engine.compiled and not engine.compiling
    assert "no-such-backend" in engine.compile_error
    assert any("serving uncompiled" in r.getMessage() or "running uncompiled" in r.getMessage()
               for r in caplog.records)
    np.testing.assert_array_equal(engine.embed(SEQUENCES), reference)


def test_waiting_engines_are_compiled_when_built_and_plain_ones_never_compile() -> None:
    waited = Engine(config=EngineConfig(device="cpu", compile=True, compile_backend="eager"))
    assert waited.compiled and not waited.compiling and waited.wait_compiled(0)
    plain = Engine(device="cpu")
    assert not plain.compiled and not plain.compiling and plain.wait_compiled(0)


def test_the_switch_comes_from_the_environment() -> None:
    assert EngineConfig.from_env({"FERN_COMPILE_IN_BACKGROUND": "1"}).compile_in_background
    assert not EngineConfig.from_env({}).compile_in_background


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's inductor backend builds C++ on the CPU; no compiler here")
def test_inductor_compiles_in_the_background_while_the_caller_keeps_stepping(reference: np.ndarray) -> None:
    """The real compiler (Dynamo and Inductor, C++ kernels on the CPU) in its thread while this one steps the
    uncompiled model on the same weights: every step's vectors stay right, and the compiled ones after."""
    engine = background_engine(backend="inductor")
    during = []
    while engine.compiling and len(during) < 10_000:
        during.append(engine.embed(SEQUENCES))
    assert engine.wait_compiled(timeout=600)
    assert engine.compiled and engine.compile_error is None
    assert during  # it served while compiling
    for vectors in during:
        np.testing.assert_array_equal(vectors, reference)
    np.testing.assert_allclose(engine.embed(SEQUENCES), reference, atol=1e-5)
