"""EXPLAIN helper for the services' plan tests."""

from __future__ import annotations

import re

import psycopg
from sqlalchemy import Connection, text

from maintd.queries import sql


def explain(conn: Connection, statement: str, schema: str, params: dict, *, generic: bool = False) -> str:
    """The plan of a statement template, as a custom plan (values known) or as the generic plan a
    prepared statement may switch to (psycopg prepares what a connection runs 5 times)."""
    if not generic:
        return "\n".join(r[0] for r in conn.execute(text("EXPLAIN " + sql(statement, schema).text), params))
    names: list[str] = []

    def placeholder(m: re.Match) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    body = re.sub(r"(?<![:\w]):(\w+)", placeholder, sql(statement, schema).text)
    raw = conn.connection.driver_connection
    literals = ", ".join(psycopg.sql.Literal(params[n]).as_string(raw) for n in names)
    args = f"({literals})" if names else ""
    conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
    conn.exec_driver_sql(f"PREPARE maintd_plan_test AS {body}")
    try:
        return "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN EXECUTE maintd_plan_test{args}"))
    finally:
        conn.exec_driver_sql("DEALLOCATE maintd_plan_test")
