"""What a pass did, from its result as stored (``service_runs.result``, ``/status``'s
``last_runs``): its counts (deleted, rescued, promoted, enqueued, reindexed; the partitioner's
rows dropped count as deleted) and one readable
line for ``maintd status``, ``/status`` and the dashboard.

Works on the stored JSON (a plain dict), so records written by an older version (keys missing)
still read; numbers are whole counts with thousands separators and durations in s/ms, never raw
floats.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable, Mapping

Result = Mapping[str, Any]


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _sum(v: Any) -> int:
    return sum(_int(n) for n in v.values()) if isinstance(v, Mapping) else 0


def _maps(v: Any) -> list[Mapping[str, Any]]:
    """The mappings of a stored list (anything else: none)."""
    return [i for i in v if isinstance(i, Mapping)] if isinstance(v, list) else []


def num(n: int) -> str:
    return f"{n:,}"


def seconds(s: float) -> str:
    """A duration for people: ``850 ms``, ``18.6 s``, ``12 min``."""
    s = abs(float(s))
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _parts(by: Any) -> str:
    """``(a 3, b 2)`` for the non-zero entries of a name -> count mapping."""
    items = [f"{k} {num(_int(n))}" for k, n in sorted(by.items()) if _int(n)] if isinstance(by, Mapping) else []
    return f" ({', '.join(items)})" if items else ""


def counts(service: str, result: Result | None) -> dict[str, int]:
    """``{"deleted": 12}`` and the like; empty for a pass without a result (failed, stopped)."""
    if not isinstance(result, Mapping):
        return {}
    if service in ("cleaner", "partitioner"):  # the partitioner's: rows of the partitions it emptied
        return {"deleted": _sum(result.get("deleted"))}
    if service == "rescuer":
        return {"rescued": _int(result.get("retried")) + _int(result.get("discarded"))
                + _int(result.get("exhausted"))}
    if service == "scheduler":
        return {"promoted": _sum(result.get("promoted"))}
    if service == "periodic":
        return {"enqueued": _enqueued(result)}
    if service == "reindexer":
        return {"reindexed": sum(1 for i in _maps(result.get("indexes")) if i.get("outcome") == "reindexed")}
    return {}


def _deleted(r: Result, verb: Callable[[str, str], str]) -> str:
    """``deleted 1,200 (completed 1,200)``: the cleaner's and the partitioner's rows gone."""
    return f"{verb('deleted', 'would delete')} {num(_sum(r.get('deleted')))}{_parts(r.get('deleted'))}"


def _cleaner(r: Result, verb: str) -> str:
    line = _deleted(r, verb)
    if _int(r.get("batches")):
        line += f" in {num(_int(r['batches']))} batch{'es' if _int(r['batches']) > 1 else ''}"
    if _int(r.get("timeouts")):
        line += f", {num(_int(r['timeouts']))} timed out"
    if _sum(r.get("skipped")):
        line += f", skipped {num(_sum(r['skipped']))}{_parts(r['skipped'])}"
    return line


def _rescuer(r: Result, verb: str) -> str:
    n = _int(r.get("retried")) + _int(r.get("discarded")) + _int(r.get("exhausted"))
    parts = {k: r.get(k) for k in ("retried", "discarded", "exhausted")}
    line = f"{verb('rescued', 'would rescue')} {num(n)}{_parts(parts)}"
    if _int(r.get("dated")):  # maintd_rows_skipped_total{reason="future_sign"}
        line += f", dated now {num(_int(r['dated']))} (sign of life in the future)"
    if _int(r.get("cleared")):  # maintd_rows_skipped_total{reason="stale_heartbeat"}
        line += f", cleared {num(_int(r['cleared']))} heartbeat_at left from an earlier attempt"
    return line + _waits(r)


def _scheduler(r: Result, verb: str) -> str:
    return f"{verb('promoted', 'would promote')} {num(_sum(r.get('promoted')))}{_parts(r.get('promoted'))}" + _waits(r)


def _waits(r: Result) -> str:
    """The pass asked for the next one before the next tick (precise timing): when (UTC)."""
    at = r.get("next_pass_at")
    if isinstance(at, str):  # as stored: ISO 8601, or str() of a datetime; with or without a fraction
        try:
            at = datetime.fromisoformat(at)
        except ValueError:
            return ""
    if not isinstance(at, datetime):
        return ""
    at = at.astimezone(timezone.utc) if at.tzinfo is not None else at
    return f"; next pass at {at:%H:%M:%S}.{at.microsecond // 1000:03d}"


def _enqueued(r: Result) -> int:
    """The jobs a periodic pass enqueued: ``enqueued_count`` (its list is bounded), or as results
    recorded before it was counted apart, the list's length."""
    listed = r.get("enqueued")
    return _int(r["enqueued_count"]) if "enqueued_count" in r else len(listed) if isinstance(listed, list) else 0


def _periodic(r: Result, verb: str) -> str:
    enqueued = _maps(r.get("enqueued"))
    ids = sorted({str(e.get("periodic_id")) for e in enqueued})
    more = ", ..." if _enqueued(r) > len(enqueued) else ""
    line = f"{verb('enqueued', 'would enqueue')} {num(_enqueued(r))}" + (f" ({', '.join(ids)}{more})" if ids else "")
    skipped = r.get("skipped")
    n = sum(_sum(v) for v in skipped.values()) if isinstance(skipped, Mapping) else 0
    if n:
        line += f", skipped {num(n)}"
    if isinstance(r.get("errors"), Mapping) and r["errors"]:
        line += f", failed {', '.join(sorted(r['errors']))}"
    if isinstance(r.get("invalid_rows"), Mapping) and r["invalid_rows"]:  # rows_skipped{reason="invalid_row"}
        line += f", rows not used (error set) {', '.join(sorted(map(str, r['invalid_rows'])))}"
    return line


def _reindexer(r: Result, verb: str) -> str:
    indexes = _maps(r.get("indexes"))
    if not indexes:
        return "no index to reindex"
    out = []
    for i in indexes:
        took = i.get("seconds") if isinstance(i.get("seconds"), (int, float)) else None
        took = f" in {seconds(took)}" if i.get("outcome") == "reindexed" and took else ""
        kept = [str(n) for n in i.get("leftovers_kept") or []] if isinstance(i.get("leftovers_kept"), list) else []
        kept_said = f" (kept leftover {', '.join(kept)}: the owner role must drop it)" if kept else ""
        out.append(f"{i.get('index')} {i.get('outcome')}{took}{kept_said}")
    return ", ".join(out)


def _partitioner(r: Result, verb: str) -> str:
    if r.get("layout") == "plain":
        return "the jobs table is plain: nothing to do"
    line = _deleted(r, verb)
    line += " (estimated)" if r.get("estimated") and _sum(r.get("deleted")) else ""
    done = [f"{k} {num(_int(r.get(k)))}" for k in ("emptied", "detached", "dropped", "made", "closed", "moved")
            if _int(r.get(k))]
    line += f"; {', '.join(done)}" if done else ""
    line += f"; partitions {num(_int(r.get('partitions')))}, stray rows {num(_int(r.get('stray_rows')))}"
    busy = [str(b) for b in r.get("busy") or []] if isinstance(r.get("busy"), list) else []
    return line + (f"; busy: {', '.join(busy)}" if busy else "")


DESCRIBE: dict[str, Callable[[Result, Callable[[str, str], str]], str]] = {
    "cleaner": _cleaner, "rescuer": _rescuer, "scheduler": _scheduler, "periodic": _periodic,
    "reindexer": _reindexer, "partitioner": _partitioner,
}


def describe(service: str, result: Result | None) -> str:
    """One line: ``deleted 1,200 (completed 1,000, discarded 200) in 2 batches``; empty for a
    pass without a result."""
    if not isinstance(result, Mapping):
        return ""
    dry = bool(result.get("dry_run"))

    def verb(done: str, would: str) -> str:
        return would if dry else done

    how = DESCRIBE.get(service)
    if how is None:  # a service this version does not know: its whole numbers
        return ", ".join(f"{k} {num(v)}" for k, v in result.items() if _int(v))
    return how(result, verb)


def annotate(service: str, result: Result | None) -> dict[str, Any]:
    """``{"counts": ..., "summary": ...}`` to add to a pass's record."""
    return {"counts": counts(service, result), "summary": describe(service, result)}


def work_seconds(started: Any, finished: Any, result: Result | None) -> float | None:
    """A recorded pass's work: from its start to its end, less the pauses it took on purpose
    (the cleaner's ``batch_pause``, the partitioner's retry pauses: ``waited_seconds`` in its
    result), as ``maintd_service_run_seconds`` measures it. ``started``, ``finished``: datetimes
    or ISO times; None when either is not a time."""
    try:
        start, end = (t if isinstance(t, datetime) else datetime.fromisoformat(t) for t in (started, finished))
        wall = (end - start).total_seconds()
    except (TypeError, ValueError):
        return None
    waited = result.get("waited_seconds") if isinstance(result, Mapping) else None
    paused = float(waited) if isinstance(waited, (int, float)) and not isinstance(waited, bool) else 0.0
    return max(0.0, wall - paused)
