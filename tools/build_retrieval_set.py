"""Writes benchmarks/data/stdlib_docstrings.json: a labelled retrieval set made from CPython's standard library.

Every public function, method and class of the standard library whose docstring has the
conventional shape (a one-line summary, a blank line, a body) gives one query and one
passage: the summary is the query, the body is the passage, and that passage is the one
relevant to it. Relevance comes from the source's own structure; nothing is judged by hand.
Bodies of every such docstring make the corpus, so each query has thousands of distractors.

The source is read with `ast` (nothing is imported or run). Summaries that occur more than
once (several functions share "Return a copy.") are left out, as are bodies that occur more
than once. QUERIES of the items, chosen with a fixed seed, are the queries.

Run by hand, once per CPython version: `python -m tools.build_retrieval_set`; the output is
committed. The text is CPython's, under the PSF License Agreement (version 2), which allows
redistribution with the notice kept (benchmarks/data/README.md).
"""

from __future__ import annotations

import ast
import json
import platform
import random
import sysconfig
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "stdlib_docstrings.json"
QUERIES = 300
SEED = 0
# Parts of the standard library that are tests, tools, GUIs or generated tables, not its API.
SKIP = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
        "dist-packages", "__pycache__", "pydoc_data", "encodings", "config-3", "venv", "__phello__"}
MIN_SUMMARY_WORDS, MAX_SUMMARY_WORDS = 4, 30
MIN_BODY_WORDS, MAX_BODY_WORDS = 15, 400


def _definitions(tree: ast.Module, module: str):
    """(qualified name, docstring) of public module-level and class-level definitions."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield f"{module}.{node.name}", ast.get_docstring(node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        yield f"{module}.{node.name}.{item.name}", ast.get_docstring(item)


def _split(doc: str | None) -> tuple[str, str] | None:
    """(summary, body) of a conventional docstring, else None."""
    if not doc:
        return None
    lines = doc.splitlines()
    if len(lines) < 3 or lines[1].strip():
        return None
    summary, body = lines[0].strip(), " ".join(" ".join(lines[2:]).split())
    if not MIN_SUMMARY_WORDS <= len(summary.split()) <= MAX_SUMMARY_WORDS:
        return None
    if not MIN_BODY_WORDS <= len(body.split()) <= MAX_BODY_WORDS:
        return None
    return summary, body


def collect(stdlib: Path) -> list[dict]:
    items = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in SKIP or part.startswith(("config-", "_")) for part in rel.parts[:-1]) \
                or (rel.name.startswith("_") and rel.name != "__init__.py") or rel.parts[0] in SKIP:
            continue
        parts = rel.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for name, doc in _definitions(tree, module):
            split = _split(doc)
            if split:
                items.append({"name": name, "summary": split[0], "body": split[1]})
    summaries = Counter(i["summary"].lower() for i in items)
    bodies = Counter(i["body"] for i in items)
    return [i for i in items if summaries[i["summary"].lower()] == 1 and bodies[i["body"]] == 1]


def build(out: Path = OUT) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = collect(stdlib)
    chosen = sorted(random.Random(SEED).sample(range(len(items)), QUERIES))
    data = {
        "name": "stdlib-docstrings",
        "source": f"CPython {platform.python_version()} standard library ({stdlib.name}), "
                  "docstrings of public functions, methods and classes",
        "license": "PSF-2.0 (Python Software Foundation License Agreement, version 2)",
        "built_by": "python -m tools.build_retrieval_set",
        "relevance": "the query is a docstring's one-line summary; the relevant passage is the "
                     "same docstring's body (one relevant passage a query)",
        "passages": [{"id": i["name"], "text": i["body"]} for i in items],
        "queries": [{"id": f"q{n}", "text": items[i]["summary"], "relevant": [items[i]["name"]]}
                    for n, i in enumerate(chosen)],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", "utf-8")
    return data


if __name__ == "__main__":
    built = build()
    print(f"{OUT}: {len(built['passages'])} passages, {len(built['queries'])} queries")
