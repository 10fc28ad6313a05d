"""Measures whether PostgreSQL's own parser (pglast) could replace the Postgres endpoint's SQL lexer: every case the grammar tests pin, run through both, and µs per statement.

    python tools/pglast_vs_lexer.py [--out benchmarks/results/cpu/pglast_vs_lexer.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import pglast
from pglast import parser as pg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "sidecar"))

import test_pgwire_sqlliteral as cases  # noqa: E402 - the grammar tests' own parameter lists

from sidecar.pgwire.grammar import EmbedCall, SqlError, parse  # noqa: E402

LEXICAL = {"42601", "22021", "22025"}     # SQLSTATEs the lexer/parser itself raises


def params_of(test) -> list[tuple]:
    return list(test.pytestmark[0].args[1])


def pglast_text(sql: str) -> str | None:
    """The first argument of the SELECT's one function call, as PostgreSQL's parser decodes it."""
    stmt = pglast.parse_sql(sql)[0].stmt
    arg = stmt.targetList[0].val.args[0]
    return None if arg.isnull else arg.val.sval


def literal_cases() -> dict:
    right, wrong = [], []
    for literal, value in params_of(cases.test_literals_decode_exactly):
        sql = f"SELECT embed({literal})"
        try:
            got = pglast_text(sql)
        except pg.ParseError as exc:
            got = f"ParseError: {exc.args[0]}"
        (right if got == value else wrong).append({"sql": sql, "want": value, "pglast": got})
    return {"cases": len(right) + len(wrong), "right": len(right), "wrong": wrong}


def scs_off_cases() -> dict:
    """standard_conforming_strings=off: libpg_query's scanner has it on, with no switch."""
    sqls = [("SELECT embed('a\\'b')", "a'b"), ("SELECT embed('a\\\\b')", "a\\b")]
    out = []
    for sql, want in sqls:
        try:
            got = pglast_text(sql)
        except pg.ParseError as exc:
            got = f"ParseError: {exc.args[0]}"
        out.append({"sql": sql, "want_with_scs_off": want, "pglast": got, "right": got == want})
    # U&'' is refused (0A000) with scs off; pglast accepts it whatever the session says.
    try:
        pglast_text("SELECT embed(U&'x')")
        uescape = "accepted"
    except pg.ParseError as exc:
        uescape = f"ParseError: {exc.args[0]}"
    out.append({"sql": "SELECT embed(U&'x')", "want_with_scs_off": "0A000", "pglast": uescape,
                "right": False})
    return {"cases": len(out), "right": sum(c["right"] for c in out), "detail": out}


def refusal_cases() -> dict:
    """What pglast does with each statement the grammar refuses: a ParseError (which carries
    a message and a location, never the SQLSTATE), or a parse tree an AST check on top would
    have to refuse. `sqlstate_if_42601` marks the refusals a blanket 42601 would get wrong."""
    detail = []
    for sql, sqlstate in params_of(cases.test_refusals_carry_postgres_sqlstates):
        try:
            pglast.parse_sql(sql)
            verdict, outcome = "parsed", "parsed: an AST check must refuse it"
        except pg.ParseError as exc:
            verdict, outcome = f"ParseError: {exc.args[0]}", "ParseError without SQLSTATE"
        detail.append({"sql": sql, "want": sqlstate, "pglast": verdict, "outcome": outcome,
                       "sqlstate_if_42601": verdict == "parsed" or sqlstate == "42601"})
    counts: dict[str, int] = {}
    for d in detail:
        counts[d["outcome"]] = counts.get(d["outcome"], 0) + 1
    wrong = [d["sql"] for d in detail if not d["sqlstate_if_42601"]]
    return {"cases": len(detail), "outcomes": counts,
            "parse_errors_whose_sqlstate_is_not_42601": wrong, "detail": detail}


def position_cases() -> list[dict]:
    """Where each side says the error is (ours: 1-based characters, as PostgreSQL reports)."""
    out = []
    for sql in ("SELECT embed(E'ok\\u12')", "SELECT embed('a' 'b')", "SELECT embed('open)"):
        try:
            pglast.parse_sql(sql)
            theirs = None
        except pg.ParseError as exc:
            theirs = exc.args[1]
        try:
            parse(sql)
            ours = None
        except SqlError as exc:
            ours = exc.position
        out.append({"sql": sql, "fern_position": ours, "pglast_location": theirs})
    return out


def per_statement_us(fn, sql: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn(sql)
        best = min(best, (time.perf_counter() - start) / repeat)
    return round(best * 1e6, 2)


def timings() -> list[dict]:
    text = "Fern embeds 'quoted' text, with a \\ backslash, for pgvector. " * 8
    many = ", ".join("'" + (text + str(i)).replace("'", "''") + "'" for i in range(32))
    body = ("quote ' and backslash \\ " * 45_000)[:1_000_000]
    statements = {
        "embed one short text": "SELECT embed('a short query about vectors')",
        "embed_many 32 x 500 chars (what fern.embed_many sends)":
            f"SELECT * FROM embed_many(ARRAY[{many}], '', 'lane=online')",
        "embed one 1 MB '' literal": "SELECT embed('" + body.replace("'", "''") + "')",
        "embed one 1 MB E'' literal":
            "SELECT embed(E'" + body.replace("\\", "\\\\").replace("'", "\\'") + "')",
    }
    out = []
    for name, sql in statements.items():
        repeat = 3 if len(sql) > 100_000 else 300
        ours = per_statement_us(parse, sql, repeat)
        theirs = per_statement_us(pglast.parse_sql, sql, repeat)
        out.append({"statement": name, "bytes": len(sql.encode()), "fern_lexer_us": ours,
                    "pglast_parse_sql_us": theirs, "pglast_over_fern": round(theirs / ours, 2)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/cpu/pglast_vs_lexer.json")
    args = ap.parse_args()
    assert isinstance(parse("SELECT embed('x')"), EmbedCall)
    result = {
        "command": "python tools/pglast_vs_lexer.py --out " + args.out,
        "pglast": pglast.__version__, "postgresql_parser": pg.get_postgresql_version(),
        "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "literals": literal_cases(),
        "standard_conforming_strings_off": scs_off_cases(),
        "refusals": refusal_cases(),
        "error_positions": position_cases(),
        "timings": timings(),
    }
    lit, scs, ref = result["literals"], result["standard_conforming_strings_off"], result["refusals"]
    result["summary"] = {
        "literal_values_right": f"{lit['right']}/{lit['cases']}",
        "scs_off_right": f"{scs['right']}/{scs['cases']}",
        "refusals": ref["outcomes"],
        "refusals_a_blanket_42601_gets_wrong": len(ref["parse_errors_whose_sqlstate_is_not_42601"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({"summary": result["summary"], "timings": result["timings"],
                      "error_positions": result["error_positions"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
