"""One pass of one service: run it under a :class:`PassContext`, classify its outcome, report it
(metrics, log line) and record it in ``service_runs``. The runner (daemon) and ``run-once`` (CLI)
both come through here.

Every pass is reported in this process (metrics, ``/status``); the daemon writes to
``service_runs`` only the passes that say something new (:func:`worth_recording`): the first of
each service in a term or after a reload, one that did something, one whose outcome or error
differs from the last recorded, and a failing one again every ``RECORD_FAILING_EVERY``. Idle
passes are not written, so an idle daemon writes no WAL; ``last_success_at`` is still that of the
latest successful pass (idle or not) whenever a row is written."""

from __future__ import annotations

import enum
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from .clock import UTC
from .config import Settings
from .db import HostOrder, describe_db_error, make_engine, ms, session_settings
from .logs import kv
from .metrics import Metrics, bounded_result
from .pass_summary import annotate
from .queries import service_runs
from .services import SERVICES
from .services.base import NotLeader, PassContext, PassResult, PassStopped, Service

log = logging.getLogger("maintd.passes")

RECORD_FAILING_EVERY = timedelta(minutes=5)  # a pass failing the same way is recorded this often


class Outcome(str, enum.Enum):
    SUCCESS = "success"  # the pass ran to its end
    ERROR = "error"      # the pass failed, or part of it did (e.g. one index of the reindexer)
    FENCED = "fenced"    # the database refused it: this instance does not lead (any more)
    STOPPED = "stopped"  # it gave up early: leadership lost, shutting down, or its settings changed

    def __str__(self) -> str:
        return self.value


@dataclass
class PassRecord:
    service: str
    outcome: Outcome
    started_at: datetime
    finished_at: datetime
    seconds: float  # the pass's work, not its waits (the scheduler's precise-timing sleeps)
    result: PassResult | None = None
    error: str | None = None
    # The latest successful pass of the service known to this process (None: not known), so
    # that a record of a failure after unrecorded idle successes still says when it last worked.
    last_success_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        result = bounded_result(self.result.as_dict()) if self.result is not None else {}
        return {"service": self.service, "outcome": self.outcome.value,
                "started_at": self.started_at.isoformat(), "finished_at": self.finished_at.isoformat(),
                "seconds": round(self.seconds, 6), "error": self.error, "result": result,
                **annotate(self.service, result if self.result is not None else None)}


def maintenance_engine(settings: Settings, *, pool_size: int = len(SERVICES) + 1,
                       hosts: HostOrder | None = None) -> Engine:
    """Pooled connections for maintenance transactions, bounded on both sides: by the statement
    timeout on the server (and a frozen process's open transaction is ended by the server within
    the lease), and on the client by ``tcp_user_timeout`` (a send the server does not acknowledge
    fails within the lease) and a wait for an answer that ends a lease after the statement timeout
(a frozen server's kernel keeps acknowledging), besides the keepalives and the connect timeout. Each running pass holds
    one (:meth:`PassContext.session`), the job gauges another; connections open on demand, with a
multi-host URL first to the server the lock session reached (``hosts``)."""
    return make_engine(
        settings.database_url.get_secret_value(),
        application_name=f"maintd:{settings.instance_id}:work",
        session=session_settings(settings.statement_timeout, lock_timeout=settings.leader.lease / 2,
                                 idle_in_transaction=settings.leader.lease),
        pool_size=pool_size, tcp_user_timeout=ms(settings.leader.lease), hosts=hosts,
        # a frozen server never answers: a statement gets its timeout plus a lease (longer DDL
        # lifts the bound, PassContext.autocommit)
        answer_timeout=(settings.statement_timeout + settings.leader.lease).total_seconds(),
    )


def execute_pass(name: str, service: Service, ctx: PassContext, metrics: Metrics | None = None) -> PassRecord:
    """Run one pass of ``service`` and report it; never raises for a failing pass."""
    slog = logging.getLogger(f"maintd.{name}")
    with ctx.session():
        mono = time.monotonic()
        try:
            started = finished = ctx.now()
        except Exception as exc:  # the server cannot be asked: asked again by the pass and at its
            # end, it would cost each connect timeout again to fail the same way
            started = finished = datetime.now(UTC)
            result, outcome, error = _failed(name, exc, ctx, slog)
        else:
            result, outcome, error = _run(name, service, ctx, slog)
            finished = _now(ctx, default=started)
        work = time.monotonic() - mono - (result.waited() if result is not None else 0.0)
        record = PassRecord(name, outcome, started, finished, work, result, error)
    if metrics is not None:
        _observe(metrics, service, record, ctx)
    if result is not None and result.did_something():
        # The service's name is fixed text; what the pass did (queue names) is a field.
        cut = {"outcome": outcome.value} if outcome is not Outcome.SUCCESS else {}  # part of a pass
        slog.info(f"{name} pass", extra=kv(result=result.summary(), seconds=round(record.seconds, 3), **cut))
    return record


def _run(name: str, service: Service, ctx: PassContext,
         slog: logging.Logger) -> tuple[PassResult | None, Outcome, str | None]:
    try:
        result = service.run_once(ctx)
    except NotLeader as exc:  # with what its committed transactions did (as below)
        slog.warning("pass refused: not the leader", extra=kv(service=name, reason=str(exc)))
        return ctx.partial, Outcome.FENCED, str(exc)
    except PassStopped:  # with what its committed transactions did
        return ctx.partial, Outcome.STOPPED, "stopped: leadership lost, shutting down, or its settings changed"
    except Exception as exc:  # a failing pass never kills the daemon
        return _failed(name, exc, ctx, slog)
    if result.failed():
        return result, Outcome.ERROR, f"part of the pass failed: {result.summary()}"
    return result, Outcome.SUCCESS, None


def _failed(name: str, exc: Exception, ctx: PassContext,
            slog: logging.Logger) -> tuple[PassResult | None, Outcome, str]:
    if ctx.should_stop():  # e.g. its query was cancelled because we lost leadership
        return ctx.partial, Outcome.STOPPED, f"stopped: {describe_db_error(exc)}"
    error = describe_db_error(exc)
    slog.error("pass failed", extra=kv(service=name, error=error), exc_info=slog.isEnabledFor(logging.DEBUG))
    return ctx.partial, Outcome.ERROR, error  # its batches committed before the failure count


def _now(ctx: PassContext, default: datetime) -> datetime:
    """The server's time for the record; ``default`` when the server cannot be asked."""
    try:
        return ctx.now()
    except Exception:
        return default


def _observe(metrics: Metrics, service: Service, record: PassRecord, ctx: PassContext) -> None:
    metrics.service_runs.labels(record.service, record.outcome.value).inc()
    metrics.service_run_seconds.labels(record.service).observe(record.seconds)
    if record.outcome is Outcome.SUCCESS:
        metrics.service_last_success.labels(record.service).set(record.finished_at.timestamp())
    if ctx.moved:  # SQLSTATE 40001 on the partitioned layout: rows finished meanwhile, skipped
        metrics.rows_skipped.labels(record.service, "moved").inc(ctx.moved)
    if record.result is not None and not ctx.dry_run:
        service.observe(metrics, record.result)
        for reason, n in record.result.skipped_rows().items():
            if n:
                metrics.rows_skipped.labels(record.service, reason).inc(n)


def worth_recording(previous: PassRecord | None, record: PassRecord) -> bool:
    """Whether the daemon writes ``record`` to ``service_runs``, given the last pass of the
    service it wrote in this term (None: none yet)."""
    if previous is None or record.outcome is not previous.outcome or record.error != previous.error:
        return True
    if record.result is not None and record.result.did_something():
        return True
    return record.outcome is not Outcome.SUCCESS and record.finished_at - previous.finished_at >= RECORD_FAILING_EVERY


def record_pass(ctx: PassContext, record: PassRecord) -> bool:
    """Write the pass to ``service_runs`` in a fenced transaction of its own; True when it was
    written. Raises NotLeader when the term is over; other failures are logged (the record is
    bookkeeping only)."""
    last_success = record.finished_at if record.outcome is Outcome.SUCCESS else record.last_success_at
    try:
        with ctx.transaction() as conn:
            conn.execute(ctx.sql(service_runs.RECORD), {
                "service": record.service, "instance": ctx.instance_id, "started": record.started_at,
                "finished": record.finished_at, "outcome": record.outcome.value,
                "result": json.dumps(record.as_dict()["result"], default=str), "error": record.error,
                "last_success": last_success,
            })
        return True
    except (NotLeader, PassStopped):
        raise
    except Exception as exc:
        log.warning("could not record the pass", extra=kv(service=record.service,
                                                          error=describe_db_error(exc)))
        return False
