"""Fern's reproducible benchmark harness: engine, end-to-end gRPC and baseline runs writing JSON and plots."""
