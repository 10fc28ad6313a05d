"""The catalogue of vectorizers (fern.vectorizers): its rows as `Vectorizer`s, read and inserted."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from adapters.postgres.errors import VectorizerError
from adapters.postgres.names import resolve_table
from adapters.postgres.template import Template, parse_template, text_expression

if TYPE_CHECKING:
    from sidecar.client import FernClient, ModelInfo

_DISTANCE_OP = {"cosine": "<=>", "dot": "<#>"}


@dataclass(frozen=True)
class Vectorizer:
    """One row of fern.vectorizers."""

    id: int
    table_schema: str
    table_name: str
    target_column: str
    key_columns: tuple[str, ...]
    key_types: tuple[str, ...]
    source_columns: tuple[str, ...]
    template: str
    model: str
    dimensions: int
    max_tokens: int
    distance: str
    prompt: str | None
    chunking: str
    chunk_table: str | None
    chunk_tokens: int | None
    chunk_overlap: int | None
    hybrid: bool
    tsv_column: str | None
    language: str | None
    generation: int
    replaces: int | None
    tsv_created: bool = False
    # The sparsevec column beside the vector column (or in the chunk table), None when none;
    # sparse_learned: its vectors are the model's learned weights, else BM25 lexical terms.
    sparse_column: str | None = None
    sparse_learned: bool = False
    # Set while the vectorizer's SQL fails and workers skip it (see worker.py).
    parked_error: str | None = field(default=None, compare=False)
    parked_at: datetime | None = field(default=None, compare=False)
    backfilled: int = field(default=0, compare=False)

    @property
    def table(self) -> sql.Identifier:
        return sql.Identifier(self.table_schema, self.table_name)

    @property
    def qualified_table(self) -> str:
        return f"{self.table_schema}.{self.table_name}"

    @property
    def chunks(self) -> sql.Identifier:
        assert self.chunk_table is not None
        return sql.Identifier(self.table_schema, self.chunk_table)

    @property
    def parsed_template(self) -> Template:
        return parse_template(self.template)

    def text_sql(self, alias: str | None = None) -> sql.Composed:
        """The row's text as an SQL expression over `alias` (the template, rendered)."""
        return text_expression(self.parsed_template, alias)

    def key_json_sql(self, alias: str) -> sql.Composed:
        """jsonb_build_array(alias.k1, ...): how a row key is stored in fern.queue."""
        return sql.SQL("jsonb_build_array({})").format(
            sql.SQL(", ").join(sql.Identifier(alias, k) for k in self.key_columns))

    def key_match_sql(self, alias: str, json_expr: sql.Composable) -> sql.Composed:
        """alias.k1 = (json->>0)::type1 AND ...: a row matched by its queued key."""
        return sql.SQL(" AND ").join(
            sql.SQL("{} = ({} ->> {})::{}").format(sql.Identifier(alias, k), json_expr,
                                                   sql.Literal(n), sql.SQL(t))
            for n, (k, t) in enumerate(zip(self.key_columns, self.key_types)))

    @property
    def sparse_table(self) -> sql.Identifier:
        """The table holding the sparse column: the chunk table in split mode, else the table."""
        return self.chunks if self.chunking == "split" else self.table

    def distance_operator(self) -> sql.SQL:
        return sql.SQL(_DISTANCE_OP[self.distance])


_COLUMNS = [f.name for f in Vectorizer.__dataclass_fields__.values() if f.name != "backfilled"]
# The columns a vectorizer's configuration sets: the table assigns id and generation, workers park.
_INSERTED = [c for c in _COLUMNS if c not in ("id", "generation", "parked_error", "parked_at")]
_INSERT = sql.SQL("INSERT INTO fern.vectorizers ({}) VALUES ({}) RETURNING *").format(
    sql.SQL(", ").join(map(sql.Identifier, _INSERTED)),
    sql.SQL(", ").join(sql.Placeholder() * len(_INSERTED)))


def from_row(row: dict) -> Vectorizer:
    """The Vectorizer of a fern.vectorizers row read with psycopg's dict_row."""
    values = {k: row[k] for k in _COLUMNS}
    for k in ("key_columns", "key_types", "source_columns"):
        values[k] = tuple(values[k])
    return Vectorizer(**values)


def list_vectorizers(conn: psycopg.Connection) -> list[Vectorizer]:
    """Every vectorizer, shadows of model changes included, in id order."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM fern.vectorizers ORDER BY id")
        return [from_row(r) for r in cur.fetchall()]


def get_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str],
                   target_column: str | None = None) -> Vectorizer:
    """The (non-shadow) vectorizer on `table` (and `target_column` when the table has several)."""
    schema, name = resolve_table(conn, table)
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("""SELECT * FROM fern.vectorizers
                        WHERE table_schema = %s AND table_name = %s AND replaces IS NULL
                          AND (%s::text IS NULL OR target_column = %s) ORDER BY id""",
                    (schema, name, target_column, target_column))
        rows = cur.fetchall()
    if not rows:
        raise VectorizerError(f"table {schema}.{name} has no vectorizer"
                              + (f" on column {target_column!r}" if target_column else ""))
    if len(rows) > 1:
        raise VectorizerError(f"table {schema}.{name} has {len(rows)} vectorizers; "
                              f"name the target column ({', '.join(r['target_column'] for r in rows)})")
    return from_row(rows[0])


def vectorizer_by_id(conn: psycopg.Connection, v_id: int) -> Vectorizer | None:
    """The row of vectorizer `v_id` as it is now, or None when it was dropped."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT * FROM fern.vectorizers WHERE id = %s", (v_id,)).fetchone()
    return None if row is None else from_row(row)


def insert_vectorizer(conn: psycopg.Connection, v: Vectorizer) -> Vectorizer:
    """Insert `v` as a new row and return the row as stored (the table sets its id and generation)."""
    values = [list(value) if isinstance(value, tuple) else value
              for value in (getattr(v, c) for c in _INSERTED)]
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_INSERT, values)
        return from_row(cur.fetchone())


def model_info(client: FernClient | None, model: str) -> ModelInfo:
    """What the sidecar serves as `model` (its dimensions, limit, distance); `client` None: a default one."""
    if client is not None:
        return client.model(model)
    from sidecar.client import FernClient

    # A client made here for one call is closed here, not left holding a gRPC channel.
    with FernClient() as own:
        return own.model(model)
