-- The synchronous fern.embed() / fern.embed_many(): SQL functions that call the sidecar's
-- Postgres-protocol endpoint through dblink, over one persistent connection per session.
-- Applied once by adapters.postgres.embed_function.install(), which then points the foreign
-- server at the endpoint, keeps the secret in a user mapping, sets the functions' search_path
-- and default model, and grants EXECUTE. Version 1001: outside the core schema's numbers.

CREATE EXTENSION IF NOT EXISTS dblink;
CREATE EXTENSION IF NOT EXISTS vector;

-- Where the endpoint is (host, port: not secret) and, in the user mapping of the functions'
-- owner, the password, which pg_user_mappings shows to that role and superusers only.
-- No one else gets USAGE: callers reach the server only through the SECURITY DEFINER
-- functions below.
CREATE SERVER fern_sidecar FOREIGN DATA WRAPPER dblink_fdw;
REVOKE ALL ON FOREIGN SERVER fern_sidecar FROM PUBLIC;

-- (Re)open the session's named connection 'fern_sidecar'; a failure names Fern.
CREATE FUNCTION fern._sidecar_connect() RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    detail text;
BEGIN
    IF 'fern_sidecar' = ANY (coalesce(dblink_get_connections(), '{}')) THEN
        PERFORM dblink_disconnect('fern_sidecar');
    END IF;
    PERFORM dblink_connect('fern_sidecar', 'fern_sidecar');
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
    RAISE EXCEPTION 'Fern sidecar unreachable: fern.embed could not connect to the sidecar''s SQL endpoint (foreign server fern_sidecar): %',
        coalesce(nullif(detail, ''), SQLERRM)
        USING ERRCODE = 'connection_exception',
              HINT = 'Start the sidecar with `fern serve --pg-port PORT --token TOKEN` (or re-run '
                     '`fern pg install --sql-endpoint HOST:PORT`). Writes that must not depend on '
                     'the sidecar belong in a vectorizer (queue + worker).';
END
$fn$;
REVOKE ALL ON FUNCTION fern._sidecar_connect() FROM PUBLIC;

-- One `SELECT * FROM embed_many(...)` on the session's connection, rows (ord, vector text):
-- connect on first use, reconnect once when the connection has gone stale (sidecar
-- restarted), and name Fern in every error.
CREATE FUNCTION fern._sidecar_query(query text) RETURNS TABLE (i int, v text)
LANGUAGE plpgsql AS $fn$
DECLARE
    state text;
    msg text;
    detail text;
    hint text;
BEGIN
    FOR attempt IN 1..2 LOOP
        IF attempt = 2 OR NOT ('fern_sidecar' = ANY (coalesce(dblink_get_connections(), '{}'))) THEN
            PERFORM fern._sidecar_connect();
        END IF;
        BEGIN
            RETURN QUERY SELECT r.i, r.v FROM dblink('fern_sidecar', query) AS r(i int, v text);
            RETURN;
        EXCEPTION
            WHEN connection_exception OR admin_shutdown THEN
                IF attempt = 2 THEN
                    GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
                    RAISE EXCEPTION 'Fern sidecar unreachable: the SQL endpoint connection failed: %', msg
                        USING ERRCODE = 'connection_exception', DETAIL = coalesce(detail, ''),
                              HINT = 'Is `fern serve --pg-port` running?';
                END IF;
            WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT,
                                        detail = PG_EXCEPTION_DETAIL, hint = PG_EXCEPTION_HINT;
                RAISE EXCEPTION 'Fern: %', msg
                    USING ERRCODE = state, DETAIL = coalesce(detail, ''), HINT = coalesce(hint, '');
        END;
    END LOOP;
END
$fn$;
REVOKE ALL ON FUNCTION fern._sidecar_query(text) FROM PUBLIC;

-- The caller's options plus its statement_timeout as timeout_ms: when the timeout fires,
-- dblink still waits for the answer it asked for, so the sidecar must drop the work by
-- itself (at most one timeout after the call began).
CREATE FUNCTION fern._with_timeout(options text) RETURNS text
LANGUAGE sql STABLE AS $fn$
    SELECT CASE WHEN s.ms > 0 AND position('timeout_ms' IN lower(coalesce(options, ''))) = 0
                THEN coalesce(options, '') || ',timeout_ms=' || s.ms
                ELSE coalesce(options, '') END
      FROM (SELECT (extract(epoch FROM current_setting('statement_timeout')::interval)
                    * 1000)::bigint AS ms) AS s
$fn$;
REVOKE ALL ON FUNCTION fern._with_timeout(text) FROM PUBLIC;

-- The vector of one text (NULL for NULL). `model` '' is the installed default; `options` as
-- 'lane=batch,dimensions=256,prompt=query,normalize=false,truncate=false'. IMMUTABLE so that
-- `ORDER BY emb <=> fern.embed('…')` embeds once per query, and generated columns may use it:
-- it holds while the sidecar serves the same model under that name.
CREATE FUNCTION fern.embed(input text, model text DEFAULT '', options text DEFAULT '')
RETURNS vector
LANGUAGE plpgsql IMMUTABLE SECURITY DEFINER AS $fn$
DECLARE
    result text;
BEGIN
    IF input IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT q.v INTO result FROM fern._sidecar_query(format('SELECT * FROM embed_many(ARRAY[%L], %L, %L)', input,
        coalesce(nullif(model, ''), current_setting('fern.default_model', true), ''),
        fern._with_timeout(options))) AS q;
    RETURN result::vector;
END
$fn$;

-- One row per element, in order: (ord 1..n, embedding); NULL elements give NULL embeddings.
CREATE FUNCTION fern.embed_many(inputs text[], model text DEFAULT '', options text DEFAULT '')
RETURNS TABLE (ord int, embedding vector)
LANGUAGE plpgsql IMMUTABLE SECURITY DEFINER ROWS 100 AS $fn$
DECLARE
    query text;
BEGIN
    IF inputs IS NULL OR cardinality(inputs) = 0 THEN
        RETURN;
    END IF;
    SELECT format('SELECT * FROM embed_many(ARRAY[%s], %L, %L)',
                  string_agg(quote_nullable(u.t), ',' ORDER BY u.n),
                  coalesce(nullif(model, ''), current_setting('fern.default_model', true), ''),
                  fern._with_timeout(options))
      INTO query FROM unnest(inputs) WITH ORDINALITY AS u(t, n);
    RETURN QUERY SELECT q.i, q.v::vector FROM fern._sidecar_query(query) AS q;
END
$fn$;

REVOKE ALL ON FUNCTION fern.embed(text, text, text), fern.embed_many(text[], text, text) FROM PUBLIC;
