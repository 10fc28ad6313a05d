"""What the scheduler raises to callers; each maps to one gRPC status."""

from __future__ import annotations

from sidecar.lanes import Request


class QueueFull(Exception):
    """The lane's queue has no room for the request (gRPC RESOURCE_EXHAUSTED)."""


class Draining(Exception):
    """The scheduler is shutting down and accepts no new work (gRPC UNAVAILABLE)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before all its sequences ran (gRPC DEADLINE_EXCEEDED)."""


def deadline_passed(request: Request) -> DeadlineExceeded:
    """The error of a request whose deadline passed before all its sequences were embedded."""
    return DeadlineExceeded(
        f"deadline passed with {request.remaining} of {request.size} sequences not embedded"
    )
