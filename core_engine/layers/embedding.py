"""Embedding tables, built without a random fill: every table comes from the checkpoint."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding that skips its initial fill.

    Models are built on the meta device and their weights loaded after, so the fill is
    wasted; and on the meta device nn.Embedding's ``normal_`` runs through torch's Python
    reference ops, whose first call imports torch._dynamo: 1.1 s of start-up on the 2-core
    machine for an engine that never compiles.
    """

    def reset_parameters(self) -> None:
        pass
