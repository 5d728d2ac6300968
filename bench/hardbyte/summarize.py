#!/usr/bin/env python3
"""The per-layout per-phase table from a harness run directory (raw.csv): writes results.json and
results.md into ``out``.   python bench/hardbyte/summarize.py RUN_DIR [OUT]"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("clean_1", "idle_1", "recovery_1")
MEDIANS = ("claim_p50_ms", "claim_p99_ms", "claim_stmt_p50_ms", "claim_stmt_p99_ms",
           "completion_rate", "enqueue_rate", "queue_depth")
LASTS = ("jobs_dead_tuples", "jobs_total_mb", "jobs_live_tuples")
FIRSTS = ("maintd_status_named_holder_s", "maintd_log_named_holder_s")


def load(run_dir: Path) -> dict:
    """(system, phase, metric[@subject]) -> [values in time order]"""
    series: dict = defaultdict(list)
    with open(run_dir / "raw.csv") as fh:
        for row in csv.DictReader(fh):
            if row["subject_kind"] not in ("adapter", "table"):
                continue
            key = row["metric"] if row["subject_kind"] == "adapter" else f"{row['metric']}@{row['subject']}"
            try:
                series[(row["system"], row["phase_label"], key)].append((float(row["elapsed_s"]), float(row["value"])))
            except ValueError:
                continue
    return {k: [v for _, v in sorted(vals)] for k, vals in series.items()}


def phase_row(series: dict, system: str, phase: str) -> dict:
    get = lambda m: series.get((system, phase, m), [])  # noqa: E731
    row: dict = {m: round(statistics.median(get(m)), 2) for m in MEDIANS if get(m)}
    for m in LASTS:
        if get(m):
            row[f"{m}_end"], row[f"{m}_max"] = round(get(m)[-1], 2), round(max(get(m)), 2)
    for m in FIRSTS:
        if get(m):
            row[m] = round(get(m)[0], 1)
    for key in {k for (s, p, k) in series if s == system and p == phase and "@" in k}:
        if key.split("@")[0] in ("n_dead_tup", "total_relation_size_mb"):
            row[f"harness_{key}_end"] = round(get(key)[-1], 2)
    return row


def markdown(results: dict) -> str:
    lines = ["| layout | phase | claim p50 / p99 ms (pickup) | claim stmt p50 / p99 ms | completions/s "
             "| dead tuples (end / max) | table+indexes MB (end / max) | maintd named holder (s after idle-in-tx start) |",
             "|---|---|---|---|---|---|---|---|"]
    for system, phases in results.items():
        for phase, r in phases.items():
            if not r:
                continue
            named = ""
            if phase == "idle_1":
                named = (f"/status {r.get('maintd_status_named_holder_s', 'never')}, "
                         f"log warning {r.get('maintd_log_named_holder_s', 'never')}")
            lines.append(
                f"| {system} | {phase} | {r.get('claim_p50_ms')} / {r.get('claim_p99_ms')} "
                f"| {r.get('claim_stmt_p50_ms')} / {r.get('claim_stmt_p99_ms')} | {r.get('completion_rate')} "
                f"| {r.get('jobs_dead_tuples_end', 0):,.0f} / {r.get('jobs_dead_tuples_max', 0):,.0f} "
                f"| {r.get('jobs_total_mb_end')} / {r.get('jobs_total_mb_max')} | {named} |")
    return "\n".join(lines) + "\n"


def summarize(run_dir: Path, out: Path) -> dict:
    series = load(run_dir)
    systems = sorted({s for (s, _, _) in series})
    results = {s: {p: phase_row(series, s, p) for p in PHASES} for s in systems}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"run_id": run_dir.name, "results": results}, indent=2) + "\n")
    (out / "results.md").write_text(f"run {run_dir.name}\n\n" + markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    summarize(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "results")
