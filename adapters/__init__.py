"""Fern adapters: vector databases that call the sidecar through its client."""
