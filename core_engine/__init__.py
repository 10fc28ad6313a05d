"""Fern engine: models, weight loading, packed attention, CUDA graphs and Engine.step()."""
