"""How to reach a sidecar again (target, token, timeout), so a Fern Qdrant client can be copied, pickled or given a blocking twin."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.client import AsyncFernClient, FernClient

_BEARER = "Bearer "


@dataclass(frozen=True)
class FernConnection:
    """The picklable part of a FernClient / AsyncFernClient: where it connects and as whom.

    A gRPC channel cannot be copied or pickled, so a copy of a Fern Qdrant client opens a
    new channel from this, to the same target with the same token and timeout.
    """

    target: str
    token: str = ""
    timeout: float | None = None

    @classmethod
    def of(cls, client: FernClient | AsyncFernClient) -> "FernConnection":
        # The clients keep their token only as call metadata; read it back from there.
        token = ""
        for key, value in getattr(client, "_metadata", ()):
            if key == "authorization" and value.startswith(_BEARER):
                token = value[len(_BEARER):]
        return cls(client.target, token, client.timeout)

    def blocking(self) -> FernClient:
        """A new FernClient for this connection ("" token: none, not $FERN_TOKEN)."""
        return FernClient(self.target, token=self.token, timeout=self.timeout)

    def asyncio(self) -> AsyncFernClient:
        """A new AsyncFernClient for this connection."""
        return AsyncFernClient(self.target, token=self.token, timeout=self.timeout)
