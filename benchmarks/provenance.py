"""Which code and machine a benchmark ran on: the git commit, whether the sources differ from it, a hash
of the sources, and the machine.

A copy of the working tree made for another machine can carry a `.git` whose HEAD is not
the code that was copied (the GPU device's copy does), so a commit alone can name the wrong
code. `source_sha256` is computed from the source files themselves; for any commit,
`python -m benchmarks.provenance REV` prints the same hash of that commit's sources, so a
result can be matched to its code.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("core_engine", "sidecar", "adapters", "benchmarks", "protos")
SUFFIXES = (".py", ".proto", ".sh")
EXCLUDED = ("benchmarks/results/",)


def _counted(path: str) -> bool:
    return path.endswith(SUFFIXES) and not path.startswith(EXCLUDED)


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def working_tree_sha256(root: Path = ROOT) -> str:
    """The hash of the source files as they are on disk (tracked or not)."""
    files = {}
    for top in SOURCES:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and _counted(rel) and "__pycache__" not in path.parts:
                files[rel] = path.read_bytes()
    return _digest(files)


def commit_sha256(rev: str, root: Path = ROOT) -> str:
    """The same hash over the source files of commit `rev`."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", *SOURCES], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    files = {name: subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, capture_output=True,
                                  check=True).stdout
             for name in names if name and _counted(name)}
    return _digest(files)


def code_identity(root: Path = ROOT) -> dict[str, object]:
    """`git_commit` (HEAD, or None without git), `sources_match_commit` (whether the sources on
    disk are that commit's; None without git) and `source_sha256`."""
    tree = working_tree_sha256(root)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        matches: bool | None = commit_sha256(commit, root) == tree
    except (OSError, subprocess.CalledProcessError):
        commit, matches = None, None
    return {"git_commit": commit, "sources_match_commit": matches, "source_sha256": tree}


def machine() -> dict[str, Any]:
    """CPU model, cores, load average at the start (the machine is shared), platform."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: platform.processor() is what we have
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        gpu = None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "platform": platform.platform(),
            "python": platform.python_version(), "load_average": list(os.getloadavg())}


def result_header(module: str, argv: list[str] | None) -> dict[str, object]:
    """What a small benchmark's JSON starts with: its exact command, the date, the machine, the code."""
    import datetime as dt

    return {"command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(), **code_identity()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(commit_sha256(args[0]) if args else working_tree_sha256())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
