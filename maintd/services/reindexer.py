"""Reindexer (off by default): ``REINDEX INDEX CONCURRENTLY`` of the jobs indexes, one at a time.

Before each index it drops leftovers of an earlier failed concurrent build of that index (invalid
``<index>_ccnew``/``_ccold`` indexes, numbered too) with ``DROP INDEX CONCURRENTLY``. A build that
is cancelled (timeout, lost leadership, shutdown) leaves such an invalid index behind: it is
dropped right away. With ``bloat_threshold`` set, indexes whose estimated bloat is below it are
skipped (``pgstattuple``'s ``pgstatindex`` when installed, a catalog estimate otherwise).

DDL cannot run inside the fenced transaction, so the fence is checked in a short transaction right
before each index, and the build runs on its own autocommit connection that the runner can cancel.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from apscheduler.triggers.cron import CronTrigger
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from ..config import IDENT_RE
from ..db import describe_db_error, ms, quote_ident
from ..logs import kv
from ..schedules import CronSchedule, parse_schedule
from .base import PassContext, PassResult, PassStopped, Service

log = logging.getLogger("maintd.reindexer")

TABLE_INDEXES = """
SELECT c.relname AS name, i.indisvalid AS valid, pg_relation_size(c.oid) AS bytes
  FROM pg_index i
  JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_class t ON t.oid = i.indrelid
  JOIN pg_namespace n ON n.oid = t.relnamespace
 WHERE n.nspname = :schema AND t.relname = 'jobs'
 ORDER BY c.relname
"""

HAS_PGSTATTUPLE = "SELECT count(*) > 0 FROM pg_extension WHERE extname = 'pgstattuple'"

# leaf density of a btree: a fresh index is about 90 % full (the default fillfactor).
PGSTATINDEX = """
SELECT greatest(0, 90 - avg_leaf_density)::float8 AS bloat
  FROM pgstatindex(CAST(:qualified AS regclass))
"""

# Catalog estimate: pages the index would need at 90 % fill for its tuples, vs its size.
ESTIMATE = """
SELECT CASE WHEN c.relpages <= 1 OR c.reltuples <= 0 THEN 0
            ELSE greatest(0, 100 * (1 - (c.reltuples * (8 + coalesce(w.width, 8))
                 / (current_setting('block_size')::float8 * 0.9)) / c.relpages)) END::float8 AS bloat
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN LATERAL (
       SELECT sum(s.avg_width)::float8 AS width
         FROM pg_index i
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
         JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = 'jobs' AND s.attname = a.attname
        WHERE i.indexrelid = c.oid) w ON true
 WHERE n.nspname = :schema AND c.relname = :index
"""


def artifact_pattern(index: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(index)}_cc(new|old)[0-9]*$")


@dataclass
class IndexReport:
    index: str
    outcome: str  # reindexed, skipped, missing, timeout, cancelled, error, planned
    seconds: float = 0.0
    bytes_before: int | None = None
    bytes_after: int | None = None
    bloat_percent: float | None = None
    artifacts_dropped: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class ReindexerResult(PassResult):
    indexes: list[IndexReport] = field(default_factory=list)
    dry_run: bool = False

    def did_something(self) -> bool:
        return bool(self.indexes)

    def summary(self) -> str:
        return " ".join(f"{r.index}={r.outcome}" for r in self.indexes)


class Reindexer(Service):
    name = "reindexer"

    def trigger(self) -> CronTrigger:
        cfg = self.config
        schedule = parse_schedule(cfg.schedule, cfg.timezone)
        assert isinstance(schedule, CronSchedule), "reindexer schedules are cron expressions"
        return schedule.trigger  # type: ignore[return-value]

    def run_once(self, ctx: PassContext) -> ReindexerResult:
        cfg = self.config
        result = ReindexerResult(dry_run=ctx.dry_run)
        with ctx.transaction(fenced=False) as conn:
            catalog = {r.name: r for r in conn.execute(text(TABLE_INDEXES), {"schema": ctx.schema})}
            has_pgstattuple = bool(conn.execute(text(HAS_PGSTATTUPLE)).scalar())
        artifact_re = re.compile(r"_cc(new|old)[0-9]*$")
        wanted = list(cfg.indexes) or [n for n in catalog if not artifact_re.search(n)]
        for index in wanted:
            if ctx.should_stop():
                break
            report = IndexReport(index=index, outcome="planned")
            result.indexes.append(report)
            if index not in catalog or not IDENT_RE.match(index):
                report.outcome = "missing"
                log.warning("configured index does not exist, skipping", extra=kv(index=index))
                continue
            report.bytes_before = catalog[index].bytes
            pattern = artifact_pattern(index)
            artifacts = [n for n, r in catalog.items() if pattern.match(n) and not r.valid]
            report.bloat_percent = self._bloat(ctx, index, has_pgstattuple)
            if ctx.dry_run:
                report.artifacts_dropped = artifacts
                if cfg.bloat_threshold is not None and report.bloat_percent is not None \
                        and report.bloat_percent < cfg.bloat_threshold:
                    report.outcome = "skipped"
                continue
            try:
                with ctx.transaction():  # proves we still lead, right before the DDL
                    pass
                for name in artifacts:
                    self._ddl(ctx, f"DROP INDEX CONCURRENTLY IF EXISTS {quote_ident(ctx.schema)}.{quote_ident(name)}")
                    report.artifacts_dropped.append(name)
                    log.info("dropped leftover index of a failed build", extra=kv(index=name))
                if cfg.bloat_threshold is not None and report.bloat_percent is not None \
                        and report.bloat_percent < cfg.bloat_threshold:
                    report.outcome = "skipped"
                    continue
                started = time.monotonic()
                self._ddl(ctx, f"REINDEX INDEX CONCURRENTLY {quote_ident(ctx.schema)}.{quote_ident(index)}",
                          timeout_ms=ms(cfg.timeout))
                report.seconds = round(time.monotonic() - started, 3)
                report.outcome = "reindexed"
                report.bytes_after = self._size(ctx, index)
                log.info("reindexed", extra=kv(index=index, seconds=report.seconds,
                                               bytes_before=report.bytes_before,
                                               bytes_after=report.bytes_after))
            except PassStopped:
                report.outcome = "cancelled"
                break
            except DBAPIError as exc:
                report.error = describe_db_error(exc)
                msg = str(exc.orig)
                if "statement timeout" in msg:
                    report.outcome = "timeout"
                elif "canceling statement" in msg or ctx.should_stop():
                    report.outcome = "cancelled"
                else:
                    report.outcome = "error"
                    if "must be owner" in msg or "permission denied" in msg:
                        report.error = (f"{report.error} (REINDEX CONCURRENTLY needs ownership of "
                                        "the jobs table's indexes: run the reindexer as the owner)")
                log.warning("reindex failed", extra=kv(index=index, outcome=report.outcome,
                                                       error=report.error))
                self._drop_leftovers(ctx, index, report)
                if report.outcome == "cancelled":
                    break
        return result

    # -- helpers ----------------------------------------------------------------------------
    def _ddl(self, ctx: PassContext, statement: str, timeout_ms: int | None = None) -> None:
        ctx.check_stop()
        with ctx.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql(f"SET lock_timeout = {ms(self.config.lock_timeout)}")
            conn.exec_driver_sql(f"SET statement_timeout = {timeout_ms or 0}")
            ctx.current = conn
            try:
                conn.exec_driver_sql(statement)
            finally:
                ctx.current = None
                try:
                    conn.exec_driver_sql("RESET statement_timeout")
                    conn.exec_driver_sql("RESET lock_timeout")
                except DBAPIError:
                    pass

    def _drop_leftovers(self, ctx: PassContext, index: str, report: IndexReport) -> None:
        """A cancelled REINDEX CONCURRENTLY leaves an invalid ``<index>_ccnew``: remove it now."""
        try:
            with ctx.engine.connect() as conn:
                rows = conn.execute(text(TABLE_INDEXES), {"schema": ctx.schema}).all()
            pattern = artifact_pattern(index)
            for r in rows:
                if pattern.match(r.name) and not r.valid:
                    with ctx.engine.connect() as conn:
                        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                        conn.exec_driver_sql(f"SET lock_timeout = {ms(self.config.lock_timeout)}")
                        conn.exec_driver_sql(
                            f"DROP INDEX CONCURRENTLY IF EXISTS {quote_ident(ctx.schema)}.{quote_ident(r.name)}")
                    report.artifacts_dropped.append(r.name)
                    log.info("dropped leftover of the cancelled build", extra=kv(index=r.name))
        except DBAPIError as exc:
            log.warning("could not drop the leftover index; the next pass will",
                        extra=kv(index=index, error=describe_db_error(exc)))

    def _size(self, ctx: PassContext, index: str) -> int | None:
        with ctx.engine.connect() as conn:
            return conn.execute(text("SELECT pg_relation_size(CAST(:q AS regclass))"),
                                {"q": f"{quote_ident(ctx.schema)}.{quote_ident(index)}"}).scalar()

    def _bloat(self, ctx: PassContext, index: str, has_pgstattuple: bool) -> float | None:
        try:
            with ctx.engine.connect() as conn:
                if has_pgstattuple:
                    try:
                        return round(conn.execute(text(PGSTATINDEX), {
                            "qualified": f"{quote_ident(ctx.schema)}.{quote_ident(index)}"}).scalar(), 1)
                    except DBAPIError:  # not a btree, or no permission: fall back
                        conn.rollback()
                value = conn.execute(text(ESTIMATE), {"schema": ctx.schema, "index": index}).scalar()
                return None if value is None else round(value, 1)
        except DBAPIError as exc:
            log.debug("bloat estimate failed", extra=kv(index=index, error=describe_db_error(exc)))
            return None

    def observe(self, metrics, result: ReindexerResult) -> None:
        for r in result.indexes:
            metrics.reindex.labels(r.index, r.outcome).inc()
            if r.outcome == "reindexed":
                metrics.reindex_seconds.labels(r.index).set(r.seconds)
