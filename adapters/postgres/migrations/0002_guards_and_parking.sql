-- Trigger functions only PUBLIC-proof and only for their own table; parked vectorizers;
-- which tsvector columns Fern made. Applied once by installer.install(), which then
-- regenerates every vectorizer's trigger functions with the table guard.

-- A vectorizer whose SQL fails (a renamed column, a dropped table) is parked here with its
-- error, so the others go on; a worker retries it later and clears these on success.
ALTER TABLE fern.vectorizers ADD COLUMN parked_error text;
ALTER TABLE fern.vectorizers ADD COLUMN parked_at timestamptz;
-- True when create_vectorizer added the tsvector column (drop_vectorizer then drops it).
ALTER TABLE fern.vectorizers ADD COLUMN tsv_created boolean NOT NULL DEFAULT false;
UPDATE fern.vectorizers SET tsv_created = true
 WHERE hybrid AND tsv_column = target_column || '_tsv';

-- Functions get EXECUTE for PUBLIC by default; a trigger function that PUBLIC may execute
-- can be attached by anyone with USAGE on schema fern to a table of their own.
DO $$
DECLARE f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'fern'::regnamespace
                AND p.prorettype = 'trigger'::regtype
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END $$;

DROP VIEW fern.status;
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
            SELECT v.parked_error AS error, v.parked_at AS at WHERE v.parked_error IS NOT NULL
            UNION ALL
            SELECT f.error, f.failed_at FROM fern.failed f WHERE f.vectorizer_id = v.id
            UNION ALL
            SELECT qe.last_error, qe.claimed_at FROM fern.queue qe
             WHERE qe.vectorizer_id = v.id AND qe.last_error IS NOT NULL
        ) e ORDER BY e.at DESC NULLS LAST LIMIT 1) AS last_error,
       v.parked_at IS NOT NULL AS parked
  FROM fern.vectorizers v
  CROSS JOIN LATERAL (
       SELECT count(*) FILTER (WHERE qq.claimed_by IS NULL OR qq.claimed_by NOT IN (
                  SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL)) AS pending,
              count(*) FILTER (WHERE qq.claimed_by IN (
                  SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL)) AS in_flight,
              min(qq.queued_at) AS oldest_queued_at
         FROM fern.queue qq WHERE qq.vectorizer_id = v.id) q;
