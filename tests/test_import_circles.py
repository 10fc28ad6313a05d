"""No import circles among Fern's packages (tools/check_imports.py), and the checker finds the circles it should."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
check_imports = importlib.util.module_from_spec(_SPEC)
sys.modules["check_imports"] = check_imports  # dataclasses look their module up while the file runs
_SPEC.loader.exec_module(check_imports)

def test_no_module_imports_one_that_imports_it_back() -> None:
    assert [component for component, _ in check_imports.circles(ROOT)] == []


def test_core_engine_has_no_import_circle() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "core_engine"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no import circles" in done.stdout


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_circle_through_relative_function_level_and_submodule_imports(tmp_path) -> None:
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "a.py", "from . import b\n")  # `from pkg import submodule`, relative
    _write(tmp_path / "pkg" / "b.py", "def f():\n    from pkg.sub.c import g\n")  # inside a function
    _write(tmp_path / "pkg" / "sub" / "__init__.py", "")
    _write(tmp_path / "pkg" / "sub" / "c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from ..a import x\nimport os\n")
    _write(tmp_path / "pkg" / "d.py", "import pkg.a\n")  # imports into the circle, not part of it
    found = check_imports.circles(tmp_path, ["pkg"])
    assert [component for component, _ in found] == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    edges = {(e.source, e.target, e.line) for e in found[0][1]}
    assert edges == {("pkg.a", "pkg.b", 1), ("pkg.b", "pkg.sub.c", 2), ("pkg.sub.c", "pkg.a", 3)}

    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path), "pkg"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "circle of 3: pkg.a, pkg.b, pkg.sub.c" in done.stdout
    assert "pkg/b.py:2" in done.stdout


def test_the_checker_passes_a_tree_without_circles(tmp_path) -> None:
    _write(tmp_path / "pkg" / "__init__.py", "from pkg.a import x\n")
    _write(tmp_path / "pkg" / "a.py", "import json\nx = 1\n")
    assert check_imports.circles(tmp_path, ["pkg"]) == []
    assert check_imports.main(["--root", str(tmp_path), "pkg"]) == 0
