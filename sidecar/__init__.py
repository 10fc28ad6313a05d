"""Fern's sidecar: gateway, scheduler, gRPC server, CLI and the client adapters use."""
