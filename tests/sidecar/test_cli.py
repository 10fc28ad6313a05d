"""The `fern` command: embed and models as JSON (through a sidecar and in-process), flags and env twins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sidecar import cli
from sidecar.registry import ModelSource


@pytest.fixture(scope="module")
def fern_cmd():
    script = Path(sys.executable).with_name("fern")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sidecar.cli"]


def run(cmd: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def test_fern_embed_prints_the_sidecars_vectors_as_json(fern_cmd, sidecar_target, client):
    out = run(fern_cmd, "embed", "--target", sidecar_target, "hello world", "second text")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"] == "all-MiniLM-L6-v2" and data["dimensions"] == 384
    assert data["token_counts"] == [4, 4]
    expected = client.embed(["hello world", "second text"]).vectors
    np.testing.assert_allclose(np.array(data["vectors"], dtype=np.float32), expected, atol=1e-6)


def test_fern_embed_options_and_sparse(fern_cmd, sidecar_target):
    out = run(fern_cmd, "embed", "--target", sidecar_target, "--dimensions", "16",
              "--encoding", "int8", "--sparse", "--prompt", "query", "the cat the hat")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["vectors"][0]) == 16 and max(abs(v) for v in data["vectors"][0]) == 127
    assert data["sparse"][0]["indices"] == sorted(data["sparse"][0]["indices"])


def test_fern_embed_error_names_the_input_and_exits_nonzero(fern_cmd, sidecar_target):
    out = run(fern_cmd, "embed", "--target", sidecar_target, "fine", "")
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: texts[1]: empty text" in out.stderr


def test_fern_embed_local_equals_the_sidecar(fern_cmd, client):
    out = run(fern_cmd, "embed", "--local", "--device", "cpu", "in process")
    assert out.returncode == 0, out.stderr
    local = np.array(json.loads(out.stdout)["vectors"], dtype=np.float32)
    np.testing.assert_allclose(local, client.embed(["in process"]).vectors, atol=1e-5)


def test_fern_models(fern_cmd, sidecar_target):
    out = run(fern_cmd, "models", "--target", sidecar_target)
    assert out.returncode == 0, out.stderr
    (model,) = json.loads(out.stdout)
    assert model["name"] == "all-MiniLM-L6-v2" and model["max_tokens"] == 256
    local = run(fern_cmd, "models", "--local")
    assert json.loads(local.stdout)[0]["dimensions"] == 384


def test_serve_flags_have_environment_twins(monkeypatch):
    monkeypatch.setenv("FERN_HOST", "0.0.0.0")
    monkeypatch.setenv("FERN_PORT", "6000")
    monkeypatch.setenv("FERN_DEVICE", "cpu")
    monkeypatch.setenv("FERN_TOKEN", "t0k")
    monkeypatch.setenv("FERN_MAX_STEP_TOKENS", "512")
    monkeypatch.setenv("FERN_PG_PORT", "5433")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.device, args.token) == ("0.0.0.0", 6000, "cpu", "t0k")
    assert args.max_step_tokens == 512 and args.pg_port == 5433
    flags = cli.build_parser().parse_args(["serve", "--port", "7000", "--model", "mini=/m"])
    assert flags.port == 7000 and flags.models == ["mini=/m"]


def test_serve_defaults_are_local_only():
    args = cli.build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 50051 and args.token is None
    assert args.pg_port is None and args.pg_worker_dsn is None


def test_bad_env_value_is_reported(monkeypatch):
    monkeypatch.setenv("FERN_PORT", "fifty")
    with pytest.raises(SystemExit, match="FERN_PORT='fifty' is not an integer"):
        cli.build_parser()


def test_adapter_verbs_are_registered():
    parser = cli.build_parser()
    verbs = parser._subparsers._group_actions[0].choices
    assert {"serve", "embed", "models", "demo", "pg", "qdrant", "bench"} <= set(verbs)


def test_model_source_syntax():
    assert ModelSource.parse("/models/bge") == ModelSource(Path("/models/bge"), None)
    assert ModelSource.parse("bge=/models/bge") == ModelSource(Path("/models/bge"), "bge")
    assert ModelSource.parse("default") == ModelSource(None, None)
    assert ModelSource.parse("mini=default") == ModelSource(None, "mini")


def test_serve_reports_a_bad_model_dir_without_a_traceback(fern_cmd, tmp_path):
    out = run(fern_cmd, "serve", "--port", "0", "--device", "cpu", "--model", str(tmp_path / "nope"))
    assert out.returncode == 1
    assert f"fern: model directory '{tmp_path / 'nope'}' does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_reports_a_port_in_use(fern_cmd):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run(fern_cmd, "serve", "--port", str(port), "--device", "cpu")
    assert out.returncode == 1
    assert f"fern: could not bind 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_serve_freezes_its_start_up_heap_out_of_the_collector(sidecar_process):
    """A full collection would walk ~174,000 start-up objects on the event loop (tools/profiling/gc_pause.py)."""
    line = next(l for l in sidecar_process.log().splitlines() if l.startswith("fern: serving"))
    frozen = int(re.search(r"; ([\d,]+) start-up objects frozen out of the garbage collector\)", line)[1].replace(",", ""))
    assert frozen > 100_000


def test_serve_reports_a_bad_prewarm_list_before_loading_weights(fern_cmd, monkeypatch):
    monkeypatch.setenv("FERN_PREWARM", "queries")
    assert cli.build_parser().parse_args(["serve"]).prewarm == "queries"
    out = run(fern_cmd, "serve", "--port", "0", "--device", "cpu", "--prewarm", "queries,128by4")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "fern: prewarm: '128by4' is not LENGTHxCOUNT" in out.stderr


def test_postgres_endpoint_needs_a_token(fern_cmd):
    out = run(fern_cmd, "serve", "--port", "0", "--pg-port", "0")
    assert out.returncode == 1 and "--pg-port needs --token" in out.stderr


def test_server_loop_choice(monkeypatch):
    import asyncio
    import builtins

    from sidecar import cli

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert cli._run_loop(loop_module(), "asyncio").startswith("asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert cli._run_loop(loop_module(), "auto").startswith("asyncio")
    else:
        assert cli._run_loop(loop_module(), "auto").startswith("uvloop")
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert cli._run_loop(loop_module(), "auto").startswith("asyncio")
    coro = loop_module()
    with pytest.raises(SystemExit, match="uvloop is not installed"):
        cli._run_loop(coro, "uvloop")
    coro.close()


_SHOW_GRPC_SETTING = """
import os, sys
import sidecar.cli as cli
def show(args):
    print(os.environ.get("GRPC_EXPERIMENTS"), "grpc" in sys.modules)
cli.cmd_serve = lambda args: show(args)
cli.cmd_models = lambda args: show(args)
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("verb, explicit, expected", [
    ("serve", None, "-event_engine_client,-event_engine_listener"),
    ("models", None, "-event_engine_client,-event_engine_listener"),
    ("models", "-event_engine_listener", "-event_engine_listener"),  # an explicit setting wins
])
def test_each_fern_process_turns_grpc_event_engine_off_before_grpc_loads(verb, explicit, expected):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if explicit:
        env["GRPC_EXPERIMENTS"] = explicit
    done = subprocess.run([sys.executable, "-c", _SHOW_GRPC_SETTING, verb], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [expected, "False"]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_serve_refuses_a_port_out_of_range_before_loading_anything(fern_cmd, flag):
    done = run(fern_cmd, "serve", flag, "70000")
    assert done.returncode != 0
    assert f"fern: {flag} 70000: a port is 0 to 65535" in done.stderr


def test_serve_says_where_start_up_went(sidecar_process):
    # "fern: serving M on H:P (cpu; 4.1 s after start: imports 2.3 s, models 1.5 s (weights 0.3 s); 174,202
    # start-up objects frozen out of the garbage collector)"
    line = next(line for line in sidecar_process.log().splitlines() if line.startswith("fern: serving "))
    match = re.search(r"; (\d+\.\d) s after start: imports (\d+\.\d) s, models (\d+\.\d) s(?: \(([^)]*)\))?; "
                      r"[\d,]+ start-up", line)
    assert match, line
    total, imports, models = map(float, match.groups()[:3])
    assert imports > 0 and models >= 0  # importing torch alone takes a noticeable time
    assert imports + models <= total + 0.1
    split = dict(re.fullmatch(r"(.+) (\d+\.\d) s", part).groups() for part in (match[4] or "").split(", ") if part)
    assert set(split) <= {"attention backends", "weights", "compile", "attention choice", "graph pre-warm"}
    assert sum(map(float, split.values())) <= models + 0.2


def test_the_start_up_line_splits_the_models_time_by_what_the_engines_waited_for():
    import types

    from sidecar.serve import models_split

    def engine(**seconds):
        return types.SimpleNamespace(startup_seconds={"attention": 3.0, **seconds})  # importing the backends

    registry = [types.SimpleNamespace(engines=[engine(weights=0.5, compile=120.26, choose_attention=2.0, prewarm=0.01),
                                               engine(weights=0.4, compile=0.0, choose_attention=1.0, prewarm=0.0)])]
    assert models_split(registry) == " (attention backends 6.0 s, weights 0.9 s, compile 120.3 s, attention choice 3.0 s)"
    assert models_split([types.SimpleNamespace(engines=[types.SimpleNamespace(startup_seconds={"weights": 0.01})])]) == ""


def test_serving_switches_reach_the_scheduler_and_the_tokenizer_memo(monkeypatch):
    from core_engine.settings import SidecarConfig
    from sidecar.cli import build_parser
    from sidecar.serve import _scheduler_config

    settings = SidecarConfig.from_env({"FERN_LAUNCH_ON_ARRIVAL": "0", "FERN_ONLINE_POLL_MS": "0",
                                       "FERN_TOKEN_MEMO_CHUNKS": "7", "RAYON_NUM_THREADS": "3"})
    assert (settings.token_memo_chunks, settings.tokenizer_rust_threads) == (7, 3)
    args = build_parser().parse_args(["serve", "--max-step-tokens", "4096"])
    config = _scheduler_config(args, settings)("cuda")
    assert (config.launch_on_arrival, config.online_poll_s, config.max_step_tokens) == (False, 0.0, 4096)
    assert _scheduler_config(args, SidecarConfig())("cuda").online_poll_s == 0.020
    with pytest.raises(ValueError, match="FERN_ONLINE_POLL_MS='soon': not a number"):
        SidecarConfig.from_env({"FERN_ONLINE_POLL_MS": "soon"})


def test_the_gil_switch_interval_is_python_s_own_unless_asked(monkeypatch):
    import sys

    from core_engine.settings import SidecarConfig
    from sidecar.serve import set_switch_interval

    assert SidecarConfig.from_env({}).gil_switch_interval_s is None
    assert SidecarConfig.from_env({"FERN_GIL_SWITCH_MS": "0.5"}).gil_switch_interval_s == pytest.approx(0.0005)
    with pytest.raises(ValueError, match="gil_switch_interval_s must be > 0, got 0.0"):
        SidecarConfig.from_env({"FERN_GIL_SWITCH_MS": "0"})
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: set_to.append(seconds))
    set_to: list[float] = []
    set_switch_interval(SidecarConfig())
    set_switch_interval(SidecarConfig(gil_switch_interval_s=0.0005))
    assert set_to == [0.0005]
