"""The output encodings of a vector: each one's name, wire enum number, little-endian dtype and row width.

The one table the client, the gRPC server, the HTTP door and the gateway read; it imports only
numpy and the generated protobuf module, so the client stays free of torch and grpc here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sidecar.wire import embedder_pb2 as pb


@dataclass(frozen=True)
class Encoding:
    """One output encoding: `dtype` is the little-endian numpy dtype of the packed bytes on the wire."""

    name: str
    wire: int
    dtype: np.dtype
    bits: int

    def columns(self, dimensions: int) -> int:
        """The columns of one row of `dimensions` components (binary packs 8 components a byte)."""
        return dimensions if self.bits >= 8 else (dimensions * self.bits + 7) // 8


FLOAT32 = Encoding("float32", pb.ENCODING_FLOAT32, np.dtype("<f4"), 32)
FLOAT16 = Encoding("float16", pb.ENCODING_FLOAT16, np.dtype("<f2"), 16)
INT8 = Encoding("int8", pb.ENCODING_INT8, np.dtype("i1"), 8)
BINARY = Encoding("binary", pb.ENCODING_BINARY, np.dtype("u1"), 1)

BY_NAME: dict[str, Encoding] = {e.name: e for e in (FLOAT32, FLOAT16, INT8, BINARY)}
BY_WIRE: dict[int, Encoding] = {e.wire: e for e in BY_NAME.values()}
NAMES: tuple[str, ...] = tuple(BY_NAME)
