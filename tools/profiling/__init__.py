"""Probes of one cost each (start-up, GC pauses, gRPC's floor, per-request overhead, tokenization, L2 prefetch), run by hand with `python -m tools.profiling.<probe>`."""
