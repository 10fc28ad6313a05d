-- Fern's catalogue of vectorizers, its durable work queue, failed items and status view.
-- Applied once by adapters.postgres.installer.install(), inside its transaction.

CREATE EXTENSION IF NOT EXISTS vector;

-- One row per vector column Fern keeps true to its text. A row with `replaces` set is the
-- shadow of a model change: it fills `target_column` (a new column) in the background
-- and is swapped in for the vectorizer it replaces when its queue is empty.
CREATE TABLE fern.vectorizers (
    id              serial PRIMARY KEY,
    table_schema    text NOT NULL,
    table_name      text NOT NULL,
    target_column   text NOT NULL,
    key_columns     text[] NOT NULL,
    key_types       text[] NOT NULL,
    source_columns  text[] NOT NULL,
    template        text NOT NULL,
    model           text NOT NULL,
    dimensions      int NOT NULL CHECK (dimensions > 0),
    max_tokens      int NOT NULL,
    distance        text NOT NULL DEFAULT 'cosine' CHECK (distance IN ('cosine', 'dot')),
    prompt          text,
    chunking        text NOT NULL DEFAULT 'truncate' CHECK (chunking IN ('truncate', 'split')),
    chunk_table     text,
    chunk_tokens    int,
    chunk_overlap   int,
    hybrid          boolean NOT NULL DEFAULT false,
    tsv_column      text,
    language        text,
    -- Bumped when the model changes, so a vector computed with the old model is never written.
    generation      int NOT NULL DEFAULT 1,
    replaces        int REFERENCES fern.vectorizers (id) ON DELETE CASCADE,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- One vectorizer per vector column; a split-mode shadow shares the name (its own chunk table).
CREATE UNIQUE INDEX vectorizers_target_idx ON fern.vectorizers (table_schema, table_name, target_column)
    WHERE replaces IS NULL;

-- Work to do: the key of a row whose text changed. Queue state lives here, never on the
-- user's table (an UPDATE there would rewrite the row and its HNSW entry).
-- `claimed_by` is the backend pid of the claiming worker's connection: a claim whose
-- backend is gone (worker killed) is free again at once.
CREATE TABLE fern.queue (
    id              bigserial PRIMARY KEY,
    vectorizer_id   int NOT NULL REFERENCES fern.vectorizers (id) ON DELETE CASCADE,
    row_key         jsonb NOT NULL,
    queued_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts        int NOT NULL DEFAULT 0,
    not_before      timestamptz,
    claimed_by      int,
    claimed_at      timestamptz,
    last_error      text
);
CREATE INDEX queue_vectorizer_id_idx ON fern.queue (vectorizer_id, id);

-- Inputs the sidecar rejected (INVALID_ARGUMENT), with its error text.
CREATE TABLE fern.failed (
    id              bigserial PRIMARY KEY,
    vectorizer_id   int NOT NULL REFERENCES fern.vectorizers (id) ON DELETE CASCADE,
    row_key         jsonb NOT NULL,
    error           text NOT NULL,
    attempts        int NOT NULL DEFAULT 1,
    failed_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX failed_vectorizer_id_idx ON fern.failed (vectorizer_id, failed_at);

CREATE VIEW fern.status AS
SELECT v.id AS vectorizer_id,
       format('%I.%I.%I', v.table_schema, v.table_name, v.target_column) AS name,
       v.model,
       v.replaces,
       q.pending,
       q.in_flight,
       q.oldest_queued_at,
       (SELECT count(*) FROM fern.failed f WHERE f.vectorizer_id = v.id) AS failed,
       (SELECT e.error FROM (
            SELECT f.error, f.failed_at AS at FROM fern.failed f WHERE f.vectorizer_id = v.id
            UNION ALL
            SELECT qe.last_error, qe.claimed_at FROM fern.queue qe
             WHERE qe.vectorizer_id = v.id AND qe.last_error IS NOT NULL
        ) e ORDER BY e.at DESC NULLS LAST LIMIT 1) AS last_error
  FROM fern.vectorizers v
  CROSS JOIN LATERAL (
       SELECT count(*) FILTER (WHERE qq.claimed_by IS NULL OR qq.claimed_by NOT IN (
                  SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL)) AS pending,
              count(*) FILTER (WHERE qq.claimed_by IN (
                  SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL)) AS in_flight,
              min(qq.queued_at) AS oldest_queued_at
         FROM fern.queue qq WHERE qq.vectorizer_id = v.id) q;
