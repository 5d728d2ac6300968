"""Reindexer (off by default): ``REINDEX INDEX CONCURRENTLY`` of the jobs indexes, one at a time.

Before each index it drops leftovers of an earlier failed concurrent build of that index (invalid
``<index>_ccnew``/``_ccold`` indexes, numbered too) with ``DROP INDEX CONCURRENTLY``. A build that
is cancelled (timeout, lost leadership, shutdown) leaves such an invalid index behind: it is
dropped right away. A role with MAINTAIN but not ownership (PostgreSQL 17+) may rebuild, not drop:
it rebuilds, and names the leftovers it keeps (a failed pass). With ``bloat_threshold`` set, indexes whose estimated bloat is below it are
skipped (``pgstattuple``'s ``pgstatindex`` when installed, a catalog estimate otherwise).

DDL cannot run inside the fenced transaction, so the fence is checked in a short transaction right
before each index, and the build runs on an autocommit connection of its own that the runner can
cancel. A pass in which any index failed has outcome ``error``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

from prometheus_client import Counter, Gauge
from pydantic import Field, field_validator
from sqlalchemy import Row, text
from sqlalchemy.exc import DBAPIError

from ..db import describe_db_error, ms
from ..faults import LOCK_NOT_AVAILABLE, QUERY_CANCELED
from ..identifiers import quote_catalog_name, quote_ident, validate_identifier
from ..logs import kv
from ..metrics import Family
from ..queries import catalog
from ..schedules import ScheduleTrigger, parse_schedule, schedule_trigger
from ..sections import Scheduled, ServerTimeout
from .base import NotLeader, PassContext, PassResult, PassStopped, Service

class ReindexerConfig(Scheduled):
    enabled: bool = False
    schedule: str = "0 0 * * *"
    indexes: list[str] = Field(default_factory=list)
    timeout: ServerTimeout = timedelta(minutes=1)
    lock_timeout: ServerTimeout = timedelta(seconds=5)
    bloat_threshold: float | None = Field(default=None, ge=0, le=100)

    @field_validator("indexes")
    @classmethod
    def _indexes(cls, v: list[str]) -> list[str]:
        names = [validate_identifier(name, "index name") for name in v]
        if twice := next((name for i, name in enumerate(names) if name in names[:i]), None):
            raise ValueError(f"index {twice!r} is listed twice")  # (it was rebuilt twice a pass)
        return names


log = logging.getLogger("maintd.reindexer")

REINDEX = Family(Counter, "maintd_reindex", "Indexes a pass looked at, by outcome: reindexed; skipped (below "
                 "bloat_threshold), missing, not_permitted (not attempted); timeout, cancelled, error (failed).",
                 ("index", "outcome"))
REINDEX_SECONDS = Family(Gauge, "maintd_reindex_duration_seconds", "How long the last reindex of an index took.",
                         ("index",))

ARTIFACT_RE = re.compile(r"_cc(new|old)[0-9]*$")
# SQLSTATE -> outcome of an index whose build failed (anything else: "error")
OUTCOMES = {QUERY_CANCELED: "timeout", LOCK_NOT_AVAILABLE: "timeout"}
NEEDS_OWNER = ("42501",)
# lock_timeout bounds REINDEX CONCURRENTLY's waits for the transactions older than each of its
# phases, not only its lock: one open on the jobs table for longer (a reader, pg_dump, a worker
# keeping its transaction through a job) fails the rebuild, while those waits block no one.
OLDER_TRANSACTION = ("a transaction older than the rebuild kept the jobs table for over reindexer.lock_timeout "
                     "({}); its waits block no worker: raise lock_timeout (up to timeout) to wait for such transactions")
# {table}: the index's own table, which PostgreSQL checks (jobs, or the partitioned layout's jobs_live).
# {maintain}: on PostgreSQL 17+ (which has the MAINTAIN privilege) MAINTAIN_TOO, else nothing.
NOT_PERMITTED = ("this role may not reindex it: REINDEX INDEX CONCURRENTLY needs ownership of the {table} "
                 "table{maintain}: run the reindexer as the owner role, or keep it "
                 "off (the default) and have the owner run REINDEX INDEX CONCURRENTLY")  # insufficient_privilege ("must be owner of index")
MAINTAIN_TOO = " (or MAINTAIN on it{partition})"
# MAINTAIN on a partitioned table allows REINDEX TABLE of it, not REINDEX INDEX of a partition's index.
PARTITION_PRIVILEGE = "; MAINTAIN on the partitioned jobs table does not reach its partition {table}"
PARTITIONED_INDEX = ("a partitioned index of jobs (the partitioned layout): the reindexer rebuilds the indexes of "
                     "the live partition jobs_live{}; the final states' partitions are not rebuilt (retention "
                     "drops them)")
# MAINTAIN (PostgreSQL 17+) allows REINDEX but not DROP INDEX: a failed build's leftover stays.
KEPT_LEFTOVER = ("left the leftover index {} of a failed build: DROP INDEX needs ownership of the jobs table "
                 "(MAINTAIN allows REINDEX, not DROP): the owner role must drop it (DROP INDEX CONCURRENTLY), "
                 "or run the reindexer as the owner role")


def _qualified(schema: str, index: str) -> str:
    """``"schema"."index"``: the schema validated, the index a name of the catalog (the default
    list is every index of the table, whatever its name)."""
    return f"{quote_ident(schema)}.{quote_catalog_name(index)}"


def is_artifact(name: str, index: str) -> bool:
    """Whether ``name`` is a leftover of a concurrent build of ``index``: ``<index>_ccnew``,
    ``_ccold`` (numbered when taken). PostgreSQL cuts the index's name so that the whole fits
    63 bytes (ChooseRelationName), at a character's boundary: a leftover of a longer name starts
    with a cut and is 63 bytes long, down to 60 when the cut fell inside a (UTF-8) character."""
    found = ARTIFACT_RE.search(name)
    if found is None:
        return False
    base = name[:found.start()]
    return base == index or (len(name.encode()) >= 60 and len(base) < len(index) and index.startswith(base))


@dataclass
class IndexReport:
    index: str
    outcome: str  # reindexed, skipped, missing, not_permitted, timeout, cancelled, error, planned
    seconds: float = 0.0
    bytes_before: int | None = None
    bytes_after: int | None = None
    bloat_percent: float | None = None
    artifacts_dropped: list[str] = field(default_factory=list)
    error: str | None = None
    leftovers_kept: list[str] = field(default_factory=list)  # leftovers this role may not drop (MAINTAIN)
    failed_on: str | None = None  # the leftover whose drop failed (None: the rebuild, if any)


@dataclass
class ReindexerResult(PassResult):
    indexes: list[IndexReport] = field(default_factory=list)
    dry_run: bool = False

    def did_something(self) -> bool:
        return bool(self.indexes)

    def failed(self) -> bool:
        """A build that failed, or (not in a dry run, which only reports them) an index this role
        may not rebuild or a leftover it may not drop."""
        return any(r.outcome in ("error", "timeout")
                   or (not self.dry_run and (r.outcome == "not_permitted" or r.leftovers_kept))
                   for r in self.indexes)

    def summary(self) -> str:
        """``index=outcome`` each, with the leftovers this role kept (what failed a rebuilt index)."""
        return " ".join(f"{r.index}={r.outcome}" + (f" (kept leftover {','.join(r.leftovers_kept)}: the owner "
                                                    "role must drop it)" if r.leftovers_kept else "")
                        for r in self.indexes)


class Reindexer(Service):

    METRICS = (REINDEX, REINDEX_SECONDS)
    # A rebuild cancelled by a reload would leave its invalid copy until the next scheduled pass
    # (a day, say): a changed section applies from the next pass; only disabling stops it.
    STOP_ON_CHANGE = False
    config: ReindexerConfig

    def trigger(self) -> ScheduleTrigger:
        return schedule_trigger(parse_schedule(self.config.schedule, self.config.timezone))

    def run_once(self, ctx: PassContext) -> ReindexerResult:
        result = ctx.begin(ReindexerResult(dry_run=ctx.dry_run))
        with ctx.transaction(fenced=False) as conn:
            catalog_rows = {r.name: r for r in conn.execute(text(catalog.JOBS_INDEXES), {"schema": ctx.schema})}
            pgstattuple = conn.execute(text(catalog.PGSTATTUPLE_SCHEMA)).scalar()  # its schema, or None
        wanted = list(self.config.indexes) or [n for n in catalog_rows if not ARTIFACT_RE.search(n)]
        for index in wanted:
            if ctx.should_stop():
                break
            report = IndexReport(index=index, outcome="planned")
            result.indexes.append(report)
            if index not in catalog_rows:
                self._missing(ctx, report)
                continue
            report.bytes_before = catalog_rows[index].bytes
            if not catalog_rows[index].can_reindex:
                self._not_permitted(report, catalog_rows[index])
                continue
            report.bloat_percent = self._bloat(ctx, index, pgstattuple)
            artifacts = self._leftovers(catalog_rows, report)
            try:
                if not self._reindex(ctx, report, artifacts):
                    break
            except NotLeader:  # refused before its DDL (prove_leader): no attempt to report
                result.indexes.remove(report)
                raise
        if not ctx.dry_run:  # a stop before an index's rebuild was sent: no attempt to report
            result.indexes = [r for r in result.indexes if r.outcome != "planned"]
        refused: dict[str, list[str]] = {}  # error -> indexes: one line for the pass, not one per index
        for r in result.indexes:
            if r.outcome == "not_permitted":
                refused.setdefault(r.error or "", []).append(r.index)
        for error, names in refused.items():
            log.warning("cannot reindex", extra=kv(indexes=",".join(names), error=error))
        if ctx.should_stop():  # cut short (demotion, shutdown): a stopped pass, with what it did
            raise PassStopped()
        return result

    @staticmethod
    def _missing(ctx: PassContext, report: IndexReport) -> None:
        """Not an index of the jobs table: none of that name, or another table's."""
        report.outcome = "missing"
        with ctx.engine.connect() as conn:
            found = conn.execute(text(catalog.INDEX_TABLE), {"schema": ctx.schema, "index": report.index}).first()
        if found is None:
            log.warning("configured index does not exist, skipping", extra=kv(index=report.index))
            return
        if found.partitioned and found.table == "jobs":
            report.error = PARTITIONED_INDEX.format(f", its piece there is {found.live_piece}" if found.live_piece else "")
            log.warning("configured index is a partitioned index of jobs, skipping", extra=kv(index=report.index))
            return
        report.error = f"an index of the {found.table} table, not of jobs (the reindexer rebuilds the jobs table's)"
        log.warning("configured index is not the jobs table's, skipping", extra=kv(index=report.index, table=found.table))

    @staticmethod
    def _leftovers(catalog_rows: dict, report: IndexReport) -> list[str]:
        """The index's leftovers (invalid ``_ccnew``/``_ccold``) this role may drop; those it may
        not (MAINTAIN without ownership) are kept, named in the report and a warning."""
        found = [r for n, r in catalog_rows.items() if is_artifact(n, report.index) and not r.valid]
        kept = [r.name for r in found if not r.can_drop]
        if kept:
            _keep(report, kept)
        return [r.name for r in found if r.can_drop]

    @staticmethod
    def _not_permitted(report: IndexReport, row: Row) -> None:
        """Not planned, not tried: this role may not rebuild the index (its ``JOBS_INDEXES`` row).
        MAINTAIN is named only on a server that has it (17+)."""
        report.outcome = "not_permitted"
        partition = "" if row.table == "jobs" else PARTITION_PRIVILEGE.format(table=row.table)
        report.error = NOT_PERMITTED.format(
            table=row.table, maintain=MAINTAIN_TOO.format(partition=partition) if row.has_maintain else "")

    def _healthy(self, report: IndexReport) -> bool:
        """Below the bloat threshold: not worth a rebuild."""
        threshold = self.config.bloat_threshold
        return threshold is not None and report.bloat_percent is not None and report.bloat_percent < threshold

    def _reindex(self, ctx: PassContext, report: IndexReport, artifacts: list[str]) -> bool:
        """Drop the index's leftovers, then rebuild it unless it is healthy. Returns False when
        the pass must end (stopped)."""
        if ctx.dry_run:
            report.artifacts_dropped = artifacts
            report.outcome = "skipped" if self._healthy(report) else "planned"
            return True
        try:
            ctx.prove_leader()  # right before the DDL (no transaction can fence it)
            for name in artifacts:
                self._drop(ctx, name, report)
            if self._healthy(report):
                report.outcome = "skipped"
                return True
            started = time.monotonic()
            self._ddl(ctx, f"REINDEX INDEX CONCURRENTLY {_qualified(ctx.schema, report.index)}", self.config.timeout)
            report.seconds = round(time.monotonic() - started, 3)
            report.outcome = "reindexed"
            report.bytes_after = self._size(ctx, report.index)
            log.info("reindexed", extra=kv(index=report.index, seconds=report.seconds,
                                           bytes_before=report.bytes_before, bytes_after=report.bytes_after))
            return True
        except PassStopped:  # before its statement was sent (one cut short is a DBAPIError)
            report.outcome = "cancelled" if report.artifacts_dropped else "planned"  # planned: nothing done
            return False
        except DBAPIError as exc:
            self._failed(ctx, report, exc)
            self._drop_leftovers(ctx, report)
            return report.outcome != "cancelled"

    def _failed(self, ctx: PassContext, report: IndexReport, exc: DBAPIError) -> None:
        """Classify a failed build by SQLSTATE (a cancel we asked for is ``cancelled``)."""
        sqlstate = getattr(exc.orig, "sqlstate", None)
        report.error = describe_db_error(exc)
        if report.failed_on is not None:
            report.error = f"dropping the leftover index {report.failed_on}: {report.error}"
        if ctx.should_stop():
            report.outcome = "cancelled"
        else:
            report.outcome = OUTCOMES.get(sqlstate or "", "error")
        if sqlstate == LOCK_NOT_AVAILABLE and report.failed_on is None:
            report.error += f" ({OLDER_TRANSACTION.format(_seconds(self.config.lock_timeout))})"
        if sqlstate in NEEDS_OWNER:
            report.error += (" (REINDEX CONCURRENTLY needs ownership of the jobs table's indexes: "
                             "run the reindexer as the owner)")
        log.warning("reindex failed", extra=kv(index=report.index, outcome=report.outcome,
                                               error=report.error))

    def _ddl(self, ctx: PassContext, statement: str, timeout: timedelta) -> None:
        ctx.check_stop()
        with ctx.autocommit(lock_timeout_ms=ms(self.config.lock_timeout), statement_timeout_ms=ms(timeout)) as conn:
            # Again, now that a stop cancels this connection: one that came while it was checked out
            # and given its timeouts found nothing to cancel, and the DDL would run to its end.
            ctx.check_stop()
            conn.exec_driver_sql(statement)

    @property
    def _drop_timeout(self) -> timedelta:
        """A drop waits for the transactions older than it (each wait bounded by ``lock_timeout``),
        then does the per-index work: it is bounded by both."""
        return self.config.lock_timeout + self.config.timeout

    def _drop(self, ctx: PassContext, name: str, report: IndexReport) -> None:
        try:
            self._ddl(ctx, f"DROP INDEX CONCURRENTLY IF EXISTS {_qualified(ctx.schema, name)}", self._drop_timeout)
        except DBAPIError:
            report.failed_on = name  # the error names the leftover (another session's build, say)
            raise
        report.artifacts_dropped.append(name)
        log.info("dropped leftover index of a failed build", extra=kv(index=name))

    def _drop_leftovers(self, ctx: PassContext, report: IndexReport) -> None:
        """A cancelled REINDEX CONCURRENTLY leaves an invalid ``<index>_ccnew``: remove it now
        (even when the pass is stopping: this DDL is not cancelled by the stop flag)."""
        name = report.index  # what the warning names: the index, then the leftover being dropped
        try:
            with ctx.engine.connect() as conn:
                rows = conn.execute(text(catalog.JOBS_INDEXES), {"schema": ctx.schema}).all()
            for r in rows:
                if is_artifact(r.name, report.index) and not r.valid and not r.can_drop:
                    _keep(report, [r.name])
                elif is_artifact(r.name, report.index) and not r.valid:
                    name = r.name
                    with ctx.autocommit(lock_timeout_ms=ms(self.config.lock_timeout),
                                        statement_timeout_ms=ms(self._drop_timeout)) as conn:
                        conn.exec_driver_sql(f"DROP INDEX CONCURRENTLY IF EXISTS {_qualified(ctx.schema, r.name)}")
                    report.artifacts_dropped.append(r.name)
                    log.info("dropped leftover of the cancelled build", extra=kv(index=r.name))
        except DBAPIError as exc:
            log.warning("could not drop the leftover index; the next pass will",
                        extra=kv(index=name, of=report.index, error=describe_db_error(exc)))

    def _size(self, ctx: PassContext, index: str) -> int | None:
        """The rebuilt index's size; None if it cannot be read (dropped meanwhile, say): the
        rebuild itself is done."""
        try:
            with ctx.engine.connect() as conn:
                return conn.execute(text(catalog.RELATION_SIZE), {"qualified": _qualified(ctx.schema, index)}).scalar()
        except DBAPIError as exc:
            log.warning("could not read the size of a rebuilt index", extra=kv(index=index, error=describe_db_error(exc)))
            return None

    def _bloat(self, ctx: PassContext, index: str, pgstattuple: str | None) -> float | None:
        """Estimated bloat in percent: ``pgstatindex`` when installed (``pgstattuple``: the schema
        of the extension, whose own function is called) and allowed, else the catalog estimate."""
        queries = ([(catalog.pgstatindex_bloat(pgstattuple), {"qualified": _qualified(ctx.schema, index)})]
                   if pgstattuple is not None else [])
        queries.append((catalog.ESTIMATED_BLOAT, {"schema": ctx.schema, "index": index}))
        for query, params in queries:
            try:
                with ctx.engine.connect() as conn:
                    value = conn.execute(text(query), params).scalar()
                return None if value is None else round(value, 1)
            except DBAPIError as exc:  # not a btree, or no permission: the next estimate
                log.debug("bloat estimate failed", extra=kv(index=index, error=describe_db_error(exc)))
        return None

    def observe(self, metrics, result: ReindexerResult) -> None:
        for r in result.indexes:
            metrics[REINDEX].labels(r.index, r.outcome).inc()
            if r.outcome == "reindexed":
                metrics[REINDEX_SECONDS].labels(r.index).set(r.seconds)


def _keep(report: IndexReport, names: list[str]) -> None:
    """Leftovers this role may not drop: named in the report (a failed pass) and a warning (after
    the error of a failed rebuild, if any)."""
    new = [n for n in names if n not in report.leftovers_kept]
    if not new:
        return
    report.leftovers_kept.extend(new)
    said = KEPT_LEFTOVER.format(", ".join(new))
    report.error = said if report.error is None else f"{report.error}; {said}"
    log.warning("cannot drop a leftover index", extra=kv(index=report.index, leftovers=",".join(new), error=said))


def _seconds(td: timedelta) -> str:
    return f"{td.total_seconds():g}s"
