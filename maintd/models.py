"""The shared jobs model (SPEC section 1) and maintd's own bookkeeping tables.

Tables are declared without a schema; connections translate ``None`` to the configured schema
(``schema_translate_map``), so one model serves any schema. The Alembic revisions under
``migrations/`` create exactly this (a test compares them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Enum,
    Float,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Text,
    text,
)
from datetime import timedelta

from sqlalchemy.dialects.postgresql import INTERVAL, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .queries import FINAL_STATES_SQL, JOB_STATES

metadata = MetaData(
    naming_convention={
        "pk": "%(table_name)s_pkey",
        "ck": "%(table_name)s_%(constraint_name)s_check",
    }
)

job_state = Enum(*JOB_STATES, name="job_state", metadata=metadata, create_type=True)


class Base(DeclarativeBase):
    metadata = metadata


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    queue: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'default'"))
    args: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    state: Mapped[str] = mapped_column(job_state, nullable=False, server_default=text("'available'"))
    priority: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default=text("0"))
    attempt: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default=text("25"))
    scheduled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                   server_default=text("now()"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=text("now()"))
    attempted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempted_by: Mapped[str | None] = mapped_column(Text)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalized_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    errors: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'::jsonb"))
    unique_key: Mapped[str | None] = mapped_column(Text)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, nullable=False,
                                                      server_default=text("'{}'::jsonb"))

    __table_args__ = (
        CheckConstraint("char_length(kind) BETWEEN 1 AND 128", name="kind_length"),
        CheckConstraint("char_length(queue) BETWEEN 1 AND 128", name="queue_length"),
        CheckConstraint("max_attempts > 0", name="max_attempts_positive"),
        CheckConstraint("attempt >= 0", name="attempt_not_negative"),
        CheckConstraint(f"(finalized_at IS NOT NULL) = (state IN {FINAL_STATES_SQL})",
                        name="finalized_at_iff_final"),
        CheckConstraint("jsonb_typeof(errors) = 'array'", name="errors_is_array"),
        # Worker fetch: next available job of a queue by priority, then age.
        Index("jobs_fetch_idx", "queue", "priority", "scheduled_at", "id",
              postgresql_where=text("state = 'available'")),
        # Scheduler: due scheduled/retryable jobs.
        Index("jobs_scheduled_idx", "scheduled_at", "id",
              postgresql_where=text("state IN ('scheduled', 'retryable')")),
        # Cleaner: final jobs by state and age.
        Index("jobs_finalized_idx", "state", "finalized_at", "id",
              postgresql_where=text("finalized_at IS NOT NULL")),
        # Cleaner (per-queue retention, first expired row per queue) and the dashboard's lists.
        Index("jobs_finalized_queue_idx", "state", "queue", "finalized_at", "id",
              postgresql_where=text("finalized_at IS NOT NULL")),
        # Rescuer: running jobs by last sign of life.
        Index("jobs_running_idx", text("coalesce(heartbeat_at, attempted_at)"), "id",
              postgresql_where=text("state = 'running'")),
        # Rescuer: waiting jobs with no attempt left (the claim passes them over; migration 0005).
        Index("jobs_exhausted_idx", "id",
              postgresql_where=text("state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts")),
        # At most one non-final job per unique key.
        Index("jobs_unique_key_idx", "unique_key", unique=True,
              postgresql_where=text(f"unique_key IS NOT NULL AND state NOT IN {FINAL_STATES_SQL}")),
    )


class Leader(Base):
    """The fencing record: one row, its ``epoch`` bumped by every new leader."""

    __tablename__ = "leader"

    name: Mapped[str] = mapped_column(Text, primary_key=True, server_default=text("'leader'"))
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    instance_id: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    backend_pid: Mapped[int | None] = mapped_column(Integer)
    elected_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    renewed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (CheckConstraint("name = 'leader'", name="single_row"),)


class DaemonRegistration(Base):
    """Every running maintd process registers here (for ``maintd status`` and the dashboard)."""

    __tablename__ = "daemons"

    instance_id: Mapped[str] = mapped_column(Text, primary_key=True)
    host: Mapped[str] = mapped_column(Text, nullable=False)
    pid: Mapped[int] = mapped_column(Integer, nullable=False)
    version: Mapped[str] = mapped_column(Text, nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=text("now()"))
    # The backend pid of its lock session when it last (re)connected: alive while that session is
    # (NULL: registered by a daemon before 0010, matched by its session's name alone).
    lock_pid: Mapped[int | None] = mapped_column(Integer)
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                   server_default=text("now()"))


class ServiceRun(Base):
    """Last pass of each service, written by the leader in a fenced transaction of its own after
    the pass."""

    __tablename__ = "service_runs"

    service: Mapped[str] = mapped_column(Text, primary_key=True)
    instance_id: Mapped[str] = mapped_column(Text, nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    outcome: Mapped[str] = mapped_column(Text, nullable=False)
    result: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    error: Mapped[str | None] = mapped_column(Text)
    last_success_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class PeriodicSlot(Base):
    """One row per (periodic id, slot) ever enqueued: the exactly-once guard.

    It outlives the job (the cleaner may delete the job; the slot stays taken).
    """

    __tablename__ = "periodic_slots"

    periodic_id: Mapped[str] = mapped_column(Text, primary_key=True)
    slot: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    job_id: Mapped[int | None] = mapped_column(BigInteger)
    backfilled: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    enqueued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                  server_default=text("now()"))
    instance_id: Mapped[str | None] = mapped_column(Text)
    # The schedule and time zone it was taken under (:func:`maintd.services.periodic.taken_under`);
    # NULL: taken before migration 0013.
    schedule: Mapped[str | None] = mapped_column(Text)


class PeriodicJobRow(Base):
    """A periodic schedule kept as a row (SPEC 7.10): applications manage these with SQL; the
    leader applies a change within seconds and writes ``error`` for a row it cannot use."""

    __tablename__ = "periodic_jobs"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    schedule: Mapped[str] = mapped_column(Text, nullable=False)
    timezone: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'UTC'"))
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    queue: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'default'"))
    args: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    priority: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default=text("25"))
    unique_key: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    backfill: Mapped[timedelta | None] = mapped_column(INTERVAL)
    run_on_start: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    enabled: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("true"))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=text("now()"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=text("now()"))
    resumed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # by the trigger


class HealthSample(Base):
    """One sample of a target's health history (SPEC 8.2), drawn by the dashboard's charts;
    written by the leader on change or every ten minutes, pruned by the cleaner."""

    __tablename__ = "health_history"

    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    since: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    completed: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    discarded: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    depth: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    queues: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    jobs_bytes: Mapped[int | None] = mapped_column(BigInteger)
    dead_tuples: Mapped[int | None] = mapped_column(BigInteger)
    live_tuples: Mapped[int | None] = mapped_column(BigInteger)
    horizon_age_seconds: Mapped[float | None] = mapped_column(Float)
    horizon_age_xids: Mapped[int | None] = mapped_column(BigInteger)
    holder: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
