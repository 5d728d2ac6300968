"""EXPLAIN helper for the services' plan tests."""

from __future__ import annotations

import re
from typing import Iterator

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


def index_names(layout: str, *names: str) -> tuple[str, ...]:
    """How EXPLAIN names these indexes of jobs (each as given, with its trailing space if any).
    On the partitioned layout (SPEC 8.1) the final states' partitions have their own, named after
    the partition (``jobs_completed_p20260301t120000_finalized_idx``), and every partition its own
    primary key (``..._pkey``): the plan shows the part after ``jobs``."""
    if layout != "partitioned":
        return names
    return tuple(n.removeprefix("jobs") if n.startswith(("jobs_finalized", "jobs_pkey")) else n for n in names)


SEQ_SCAN = re.compile(r"Seq Scan on (\S+)[^\n]*?\(cost=[\d.]+\.\.([\d.]+)")


def seq_scans(plan: str, layout: str = "plain") -> list[str]:
    """The relations a plan reads whole. On the partitioned layout a partition that is empty
    (estimated cost under 1) may be read so: nothing to read there (the planner's choice for a
    relation of no page)."""
    return [m.group(1) for m in SEQ_SCAN.finditer(plan) if layout != "partitioned" or float(m.group(2)) >= 1.0]


def at_page_costs(conn: Connection, costs: tuple[str, ...] = ("1.1", "4", "10")) -> Iterator[str]:
    """Each ``random_page_cost`` a plan must hold at (an SSD's, the default, a slow disk's), set in
    turn for the rest of the transaction, then reset: a plan that holds only at the default is
    near a tie, and flips with the next ANALYZE's sample (CI saw it)."""
    for cost in costs:
        conn.exec_driver_sql(f"SET LOCAL random_page_cost = {cost}")
        yield cost
    conn.exec_driver_sql("RESET random_page_cost")


def entries_read_while_a_snapshot_is_held(engine, pg_dsn: str, schema: str, name: str, work) -> tuple[object, int]:
    """``work(engine)`` (a pass, on an engine of its own) run while another session holds a
    REPEATABLE READ snapshot taken before it (a report, a pg_dump: the entries of the rows the pass
    deletes or moves cannot be marked dead meanwhile), and the entries the schema's indexes named
    like ``name`` (a partition's too) returned to it, once its sessions have ended (a backend
    reports its counts as it exits). Returns (what ``work`` returned, entries read)."""
    import time

    from sqlalchemy import create_engine

    def read() -> int:
        last, stable = -1, 0
        while stable < 3:  # the same count three times, 0.2 s apart
            with engine.connect() as conn:
                now = conn.execute(text("SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes "
                                        "WHERE schemaname = :s AND indexrelname LIKE :n"),
                                   {"s": schema, "n": f"%{name}%"}).scalar()
            stable, last = (stable + 1, last) if now == last else (0, now)
            time.sleep(0.2)
        return int(last)

    reader, pass_engine = create_engine(pg_dsn), create_engine(pg_dsn)
    try:
        with reader.connect() as snapshot:
            snapshot.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            snapshot.execute(text("SELECT count(*) FROM pg_class")).scalar()  # the snapshot is taken
            before = read()
            out = work(pass_engine)
            pass_engine.dispose()  # its sessions end and report what they read
            entries = read() - before
            snapshot.rollback()
    finally:
        reader.dispose()
        pass_engine.dispose()
    return out, entries
