"""Generated protobuf and gRPC code for the fern.v1 wire contract (regenerate: python -m sidecar.wire.generate)."""
