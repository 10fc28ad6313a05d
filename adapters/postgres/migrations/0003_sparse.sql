-- Sparse vectors beside the dense ones, and the document frequencies their BM25 IDF needs.
-- Applied once by installer.install(); vectorizers made before it keep working unchanged
-- (no sparse column, hybrid search over full text as before).

-- The sparsevec column a vectorizer fills with the sidecar's sparse vectors (NULL: none),
-- and whether those are a model's learned weights (no IDF) rather than BM25 lexical terms.
ALTER TABLE fern.vectorizers ADD COLUMN sparse_column text;
ALTER TABLE fern.vectorizers ADD COLUMN sparse_learned boolean NOT NULL DEFAULT false;

-- How many stored sparse vectors of a vectorizer hold each term (0-based index, as the
-- sidecar numbers them), kept exact by triggers on the table holding the sparse column in
-- the same transaction as every write there.
CREATE TABLE fern.sparse_df (
    vectorizer_id   int NOT NULL REFERENCES fern.vectorizers (id) ON DELETE CASCADE,
    term            bigint NOT NULL,
    df              bigint NOT NULL,
    PRIMARY KEY (vectorizer_id, term)
);

-- How many sparse vectors a vectorizer stores (N of the IDF).
CREATE TABLE fern.sparse_docs (
    vectorizer_id   int PRIMARY KEY REFERENCES fern.vectorizers (id) ON DELETE CASCADE,
    docs            bigint NOT NULL
);
