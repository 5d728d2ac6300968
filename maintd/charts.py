"""Server-rendered SVG line charts for the dashboard (SPEC 8.2): no JavaScript, no resource to
fetch (inline ``<svg>`` passes the page's ``default-src 'none'`` policy). Every text is escaped;
hovering a point or mark shows its ``<title>``.

:func:`target_charts` turns a target's history (:func:`maintd.history.series`) into the charts of
one time range: jobs by state, jobs by queue, finished jobs per minute, the jobs table's size and
dead rows, and the xmin horizon's age with its holders marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Sequence

from markupsafe import Markup, escape

from .history import LIVE_STATES, Sample

WIDTH, HEIGHT = 380, 160
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 36, 20  # the title and the legend above the plot
COLORS = ("#2f6fdf", "#e08a00", "#2a9d4b", "#9b59b6", "#c0392b", "#16a5a5", "#7f8c8d")
MARK = "#d62828"
QUEUES_SHOWN = 5


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[float, float], ...]  # (Unix time, value)
    color: str = COLORS[0]


@dataclass(frozen=True)
class Mark:
    t: float
    v: float
    label: str


@dataclass(frozen=True)
class Chart:
    key: str  # a stable id (CSS, tests)
    title: str
    series: tuple[Series, ...]
    fmt: Callable[[float], str]
    marks: tuple[Mark, ...] = field(default_factory=tuple)
    note: str = ""

    def svg(self, start: float, end: float) -> Markup:
        return line_chart(self, start, end)


def nice_max(v: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``v`` (at least 1)."""
    if v <= 1:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    return next(m * p for m in (1, 2, 5, 10) if m * p >= v)


def count(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f} M"
    if v >= 1e4:
        return f"{v / 1e3:.0f} k"
    return f"{v:,.0f}" if v >= 10 or v == int(v) else f"{v:.1f}"


def size(v: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if v < 1024:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TB"


def age(v: float) -> str:
    if v < 10:
        return f"{v:.1f} s" if v != int(v) else f"{v:.0f} s"
    if v < 120:
        return f"{v:.0f} s"
    return f"{v / 60:.0f} min" if v < 7200 else f"{v / 3600:.1f} h"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M")


def line_chart(chart: Chart, start: float, end: float) -> Markup:
    """One chart as an ``<svg>`` element: a y axis from 0, three grid lines, a line per series,
    the marks as red dots, the legend in the title row, and the range's times below."""
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    span = max(end - start, 1.0)
    top = nice_max(max((v for s in chart.series for _, v in s.points), default=0.0))

    def x(t: float) -> float:
        return LEFT + w * min(max((t - start) / span, 0.0), 1.0)

    def y(v: float) -> float:
        return TOP + h * (1 - min(max(v / top, 0.0), 1.0))

    out = [f'<svg class="chart" data-chart="{escape(chart.key)}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-label="{escape(chart.title)}">',
           f'<text x="4" y="14" class="chart-title">{escape(chart.title)}</text>']
    for i, frac in enumerate((0.0, 0.5, 1.0)):
        gy = y(top * frac)
        out.append(f'<line x1="{LEFT}" y1="{gy:.1f}" x2="{LEFT + w}" y2="{gy:.1f}" class="grid"/>'
                   f'<text x="{LEFT - 4}" y="{gy + 4:.1f}" text-anchor="end" class="tick">'
                   f'{escape(chart.fmt(top * frac))}</text>')
    for t, anchor in ((start, "start"), ((start + end) / 2, "middle"), (end, "end")):
        out.append(f'<text x="{x(t):.1f}" y="{HEIGHT - 5}" text-anchor="{anchor}" class="tick">'
                   f'{escape(_clock(t))}</text>')
    out += _legend(chart.series)
    for s in chart.series:
        pts = [(x(t), y(v)) for t, v in s.points if start <= t <= end]
        if len(pts) == 1:
            out.append(f'<circle cx="{pts[0][0]:.1f}" cy="{pts[0][1]:.1f}" r="2" fill="{s.color}">'
                       f'<title>{escape(s.label)}</title></circle>')
        elif pts:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.6">'
                       f'<title>{escape(s.label)}</title></polyline>')
    for m in chart.marks:
        if start <= m.t <= end:
            out.append(f'<circle class="mark" cx="{x(m.t):.1f}" cy="{y(m.v):.1f}" r="3.5" fill="{MARK}">'
                       f'<title>{escape(m.label)}</title></circle>')
    if not any(s.points for s in chart.series):
        out.append(f'<text x="{LEFT + w / 2:.1f}" y="{TOP + h / 2:.1f}" text-anchor="middle" class="tick">'
                   'no samples in this range yet</text>')
    out.append("</svg>")
    return Markup("".join(out))


def _legend(series: Sequence[Series]) -> list[str]:
    """One row under the title: a colour square and the name of each series (names cut at 24)."""
    out, lx = [], float(LEFT)
    for s in series:
        label = s.label[:24]
        out.append(f'<rect x="{lx:.0f}" y="19" width="9" height="9" fill="{s.color}"/>'
                   f'<text x="{lx + 12:.0f}" y="27" class="legend">{escape(label)}</text>')
        lx += 12 + 5.5 * len(label) + 12
    return out


def _t(s: Sample) -> float:
    return s.at.timestamp()


def target_charts(samples: Sequence[Sample]) -> list[Chart]:
    """The charts of one target over one range, from its history samples (oldest first)."""
    by_state = tuple(Series(state, tuple((_t(s), float(s.depth.get(state, 0))) for s in samples), COLORS[i])
                     for i, state in enumerate(LIVE_STATES))
    peak: dict[str, int] = {}
    for s in samples:
        for q, n in s.queues.items():
            peak[q] = max(peak.get(q, 0), n)
    queues = sorted(peak, key=lambda q: (-peak[q], q))[:QUEUES_SHOWN]
    by_queue = tuple(Series(q, tuple((_t(s), float(s.queues.get(q, 0))) for s in samples), COLORS[i])
                     for i, q in enumerate(queues))

    def per_minute(s: Sample, n: int) -> float:
        return n * 60.0 / max((s.at - s.since).total_seconds(), 1.0)

    finished = (Series("completed", tuple((_t(s), per_minute(s, s.completed)) for s in samples), COLORS[2]),
                Series("discarded", tuple((_t(s), per_minute(s, s.discarded)) for s in samples), COLORS[4]))
    held = [s for s in samples if s.holder]
    marks = tuple(Mark(_t(s), s.horizon_age_seconds, f"held by {_who(s.holder)} ({age(s.horizon_age_seconds)})")
                  for s in held)
    longest: dict[str, float] = {}
    for s in held:
        longest[_who(s.holder)] = max(longest.get(_who(s.holder), 0.0), s.horizon_age_seconds)
    note = "; ".join(f"held by {who}, up to {age(v)}" for who, v in sorted(longest.items(), key=lambda kv: -kv[1]))
    return [
        Chart("depth-state", "Jobs by state (waiting, running)", by_state, count),
        Chart("depth-queue", "Jobs by queue (waiting, running)", by_queue, count),
        Chart("finished", "Finished per minute", finished, count),
        Chart("size", "jobs table size (with indexes)",
              (Series("size", tuple((_t(s), float(s.jobs_bytes)) for s in samples if s.jobs_bytes is not None),
                      COLORS[0]),), size),
        Chart("dead", "jobs dead rows",
              (Series("dead", tuple((_t(s), float(s.dead_tuples)) for s in samples if s.dead_tuples is not None),
                      COLORS[1]),), count),
        Chart("horizon", "xmin horizon age (holders marked)",
              (Series("age", tuple((_t(s), s.horizon_age_seconds) for s in samples), COLORS[3]),), age, marks,
              note=note[:400]),
    ]


def _who(holder: dict) -> str:
    return str(holder.get("describe") or holder.get("kind") or "?")
