"""Attention backends behind one interface, looked up by name (``get_backend``).

Backends register a factory under a name; the engine owner's ``select.py`` decides which
name to use for a model and shape. Factories are imported lazily so a CPU-only install
never imports CUDA-only libraries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core_engine.attention.base import AttentionBackend, AttentionMetadata

BackendFactory = Callable[..., AttentionBackend]

_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``get_backend(name, ...)`` build a backend with ``factory(**kwargs)``."""
    _FACTORIES[name] = factory


def _cpu(**_: Any) -> AttentionBackend:
    from core_engine.attention.cpu import CpuAttention

    return CpuAttention()


register_backend("cpu", _cpu)


def backend_names() -> list[str]:
    """Names ``get_backend`` accepts, sorted."""
    return sorted(_FACTORIES)


def get_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Build the attention backend called ``name`` (e.g. "cpu"), passing ``kwargs`` on."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"attention backend {name!r} is unknown; choose one of {backend_names()}"
        ) from None
    return factory(**kwargs)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "backend_names",
    "get_backend",
    "register_backend",
]
