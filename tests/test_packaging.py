"""The distribution: `python -m build` gives a wheel and an sdist that install and work; the Makefile's stamps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and sdist, built from a copy of the source tree (the build leaves files behind)."""
    pytest.importorskip("build")
    work = tmp_path_factory.mktemp("build")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".pytest_cache"))
    out = work / "dist"
    # No isolation: the build backend comes from this environment, with no network.
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("fern_embed-*.whl")
    return wheel


def test_the_wheel_holds_the_packages_and_their_data_and_no_benchmarks(dist):
    names = zipfile.ZipFile(wheel_of(dist)).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"sidecar", "core_engine", "adapters", f"fern_embed-{VERSION}.dist-info",
                    f"fern_embed-{VERSION}.data"}, tops
    for data in ("adapters/postgres/migrations/0001_schema.sql",
                 "adapters/postgres/migrations/embed_function/1001_embed_function.sql",
                 "sidecar/wire/embedder_pb2.pyi",
                 "sidecar/stopwords/english.txt", "sidecar/stopwords/README.md",
                 f"fern_embed-{VERSION}.data/data/share/fern/protos/fern/v1/embedder.proto",
                 f"fern_embed-{VERSION}.dist-info/licenses/LICENSE"):
        assert data in names, data
    metadata = zipfile.ZipFile(wheel_of(dist)).read(f"fern_embed-{VERSION}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: demo" in metadata
    entry_points = zipfile.ZipFile(wheel_of(dist)).read(f"fern_embed-{VERSION}.dist-info/entry_points.txt").decode()
    assert "fern = sidecar.cli:main" in entry_points


def test_the_sdist_is_the_source_tree_a_developer_needs(dist):
    (sdist,) = dist.glob("fern_embed-*.tar.gz")
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    for needed in ("LICENSE", "Makefile", "pyproject.toml", "protos/fern/v1/embedder.proto",
                   "benchmarks/cli.py", "tests/conftest.py", "adapters/postgres/migrations/0001_schema.sql"):
        assert needed in names, needed
    assert not any(name.startswith("benchmarks/results/") for name in names)


def test_the_installed_wheel_imports_and_runs(dist, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           "--target", str(target), str(wheel_of(dist))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (target / "benchmarks").exists() and not (target / "tests").exists()
    assert (target / "share/fern/protos/fern/v1/embedder.proto").is_file()
    # The installed copy, not this checkout: the target folder alone on PYTHONPATH, run elsewhere.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FERN_DEBUG")}
    env["PYTHONPATH"] = str(target)
    probe = ("import sidecar.client, adapters.postgres.installer as i, adapters.postgres.embed_function as e; "
             "import sidecar.lexical as lex; "
             "print(sidecar.client.__file__, len(i.bundled_migrations()), 'CREATE' in e.MIGRATION.sql.upper(), "
             "all(len(lex.stopwords(language)) > 40 for language in lex.LANGUAGES))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    client_file, migrations, embed_function, stopwords = done.stdout.split()
    assert client_file.startswith(str(target)), client_file
    # The .sql files are found as package resources of the install.
    assert int(migrations) >= 1 and embed_function == "True" and stopwords == "True"
    version = subprocess.run([sys.executable, str(target / "bin" / "fern"), "--version"], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"fern {VERSION}"


def make_dry_run(folder: Path, goal: str) -> str:
    done = subprocess.run(["make", "-n", "-C", str(folder), goal], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_installs_only_the_demo_and_make_test_everything(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".fern-venv").touch()  # an existing virtualenv with torch
    run = make_dry_run(tmp_path, "run")
    assert "'.[demo]'" in run and "'.[all]'" not in run and "fern demo" in run
    test = make_dry_run(tmp_path, "test")
    assert "'.[all]'" in test and "pytest" in test
    # After `make run` installed the demo, `make run` installs nothing; `make test` still does.
    (venv / ".fern-demo-installed").touch()
    assert "pip install" not in make_dry_run(tmp_path, "run")
    assert "'.[all]'" in make_dry_run(tmp_path, "test")
    (venv / ".fern-all-installed").touch()
    assert "pip install" not in make_dry_run(tmp_path, "test")
    # A changed pyproject.toml redoes both installs.
    later = (venv / ".fern-all-installed").stat().st_mtime + 10
    os.utime(tmp_path / "pyproject.toml", (later, later))
    assert "'.[demo]'" in make_dry_run(tmp_path, "run")
    assert "'.[all]'" in make_dry_run(tmp_path, "test")
