"""PostgreSQL + pgvector adapter: vectorizers, a durable work queue, workers and search."""
