"""Qdrant adapter: Document embedding at ingest and query time, bulk ingest, hybrid search."""
