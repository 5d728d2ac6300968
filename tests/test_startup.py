"""Start-up and reload as an operator meets them (issue 15): probes answer while the database is
not there yet, SIGTERM during the start-up retries exits 0, a taken port names ``http.listen``,
restart-only keys changed by a reload say so."""

from __future__ import annotations

import signal
import socket


import pytest

from maintd.config import load_settings
from maintd.daemon import Daemon

from maintd.embedded import free_port

from .procs import START, DaemonProc, wait_for

pytestmark = pytest.mark.slow


def test_probes_answer_before_the_database_does_and_sigterm_during_retries_exits_0(schema, tmp_path):
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing?connect_timeout=1"
    d = DaemonProc(dead, schema, "early", workdir=str(tmp_path)).start()
    try:
        wait_for(lambda: d.http_get("/healthz")[0] == 200, START, what="/healthz while the database is down")
        assert d.http_get("/readyz")[0] == 503  # not connected: not ready
        # The probes answer first (HTTP starts before the first connect): the retries' line follows
        # (it lagged the first /healthz on a loaded CI machine).
        d.wait_log(r"database unreachable", timeout=START)
        d.signal(signal.SIGTERM)  # during the retries
        assert d.proc.wait(15) == 0
    finally:
        d.stop()


def test_a_config_that_keeps_thousands_of_partitions_is_warned_of_at_start(schema, tmp_path):
    """Before the first connect (the database may be down): the line names the target and the
    state, as check-config's "advice" does."""
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing?connect_timeout=1"
    d = DaemonProc(dead, schema, "many", {"layout": "partitioned", "partitions": {"interval": "1m"}},
                   workdir=str(tmp_path)).start()
    try:
        line = d.wait_log(r"warning +partitioned layout: many partitions .*discarded jobs keep about (\d+) partitions", timeout=START)
        assert line.group(1) == "10105" and f"target={schema}" in line.group(0)
        assert d.log().count("many partitions") == 3  # completed, cancelled, discarded
    finally:
        d.stop()


def test_a_taken_port_names_http_listen_and_the_address(pg_dsn, schema, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = DaemonProc(pg_dsn, schema, "port", {"http": {"listen": f"127.0.0.1:{port}"}},
                       workdir=str(tmp_path)).start()
        try:
            assert d.proc.wait(20) == 1
        finally:
            d.stop()
    assert f"http.listen 127.0.0.1:{port}: cannot listen" in d.log()


def test_a_reload_of_a_restart_only_key_says_it_needs_a_restart(pg_dsn, schema, tmp_path, maintd_log):
    cfg = tmp_path / "m.toml"
    base = f'database_url = "{pg_dsn}"\nschema = "{schema}"\ninstance_id = "r1"\n[http]\nenabled = false\n'
    cfg.write_text(base + '[leader]\nlease = "10s"\n')
    daemon = Daemon(load_settings(str(cfg)), config_path=str(cfg))
    try:
        cfg.write_text(base + '[leader]\nlease = "30s"\n[cleaner]\ninterval = "7s"\n')
        assert daemon.reload_from_file()
        assert any("needs a restart" in line and "keys=leader" in line for line in maintd_log), maintd_log
        assert daemon.settings.leader.lease.total_seconds() == 10  # kept
        assert daemon.settings.cleaner.interval.total_seconds() == 7  # applied
    finally:
        daemon.stop()


def test_a_reload_that_fails_says_so_and_not_that_the_config_was_reloaded(pg_dsn, schema, tmp_path, maintd_log,
                                                                          monkeypatch):
    """A reload whose applying raises goes back to the old settings and says "config reload
    failed, keeping the old config". Going back ran the reload again, which ended with "config
    reloaded" as if the new file had been applied: the last line an operator read said the
    opposite of what happened. The old config is back, and said as kept."""
    from maintd import daemon as daemon_module
    from maintd.target import Target

    cfg = tmp_path / "m.toml"
    base = f'database_url = "{pg_dsn}"\nschema = "{schema}"\ninstance_id = "r1"\n[http]\nenabled = false\n'
    cfg.write_text(base + '[cleaner]\ninterval = "5s"\n')
    daemon = Daemon(load_settings(str(cfg)), config_path=str(cfg))
    try:
        reload = Target.reload
        calls: list = []

        def fails_once(self, settings):
            calls.append(settings)
            if len(calls) == 1:
                raise RuntimeError("boom")
            reload(self, settings)

        monkeypatch.setattr(Target, "reload", fails_once)
        monkeypatch.setattr(daemon_module, "setup_logging", lambda *a: None)  # (it would drop maintd_log's handler)
        cfg.write_text(base + '[cleaner]\ninterval = "7s"\n')
        maintd_log.clear()
        assert not daemon.reload_from_file()
        assert any("config reload failed" in line and "boom" in line for line in maintd_log), maintd_log
        assert not any("config reloaded" in line for line in maintd_log), maintd_log
        assert daemon.settings.cleaner.interval.total_seconds() == 5  # the old config, back
    finally:
        daemon.stop()


def test_a_reload_that_cannot_change_the_targets_keeps_describing_the_running_ones(pg_dsn, schema, tmp_path,
                                                                                   maintd_log):
    """Adding, removing or moving a target needs a restart, and the reload says so; but the
    daemon took the new file's targets as its own all the same: /status switched to the
    several-targets shape and the dashboard listed (and opened reader pools to) a target it did
    not run, one pool more per reload. Its other keys still apply: a section, metrics.max_queues
    (was logged as reloaded and ignored) and an instance_id set in the file (ignored unsaid)."""
    cfg = tmp_path / "m.toml"
    base = f'database_url = "{pg_dsn}"\nschema = "{schema}"\n'
    cfg.write_text(base + 'instance_id = "r1"\n[http]\nenabled = false\n')
    daemon = Daemon(load_settings(str(cfg)), config_path=str(cfg))
    try:
        moved = pg_dsn.replace("127.0.0.1:5432", "127.0.0.1") if ":5432" in pg_dsn else pg_dsn + "?sslmode=disable"
        cfg.write_text(base + 'instance_id = "r2"\n[http]\nenabled = false\n[metrics]\nmax_queues = 3\n[cleaner]\ninterval = "7s"\n'
                       f'[[targets]]\nschema = "{schema}"\n[[targets]]\nname = "other"\nschema = "{schema}_b"\n'
                       f'database_url = "{moved}"\n')
        assert daemon.reload_from_file()
        assert any("targets need a restart" in line for line in maintd_log), maintd_log
        assert any("needs a restart" in line and "instance_id" in line for line in maintd_log), maintd_log
        assert daemon.settings.targets == [] and [t.target_name for t in daemon.settings.target_settings()] == [schema]
        assert daemon.settings.instance_id == "r1"
        assert daemon.targets[0].settings.cleaner.interval.total_seconds() == 7  # applied
        assert daemon.targets[0].metrics.max_queues == 3
    finally:
        daemon.stop()


def test_the_readme_lists_every_key_a_reload_keeps_until_a_restart(pg_dsn, schema, tmp_path, maintd_log):
    """README "Signals" lists the keys a reload keeps as they were (`http.listen` of the [http]
    section); `http.enabled` is kept too (the listener is not started or stopped by a reload), with
    the same "needs a restart" line, and the README did not say so."""
    import re
    from pathlib import Path

    from maintd.daemon import RESTART_ONLY

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = re.search(r"Keys that need a restart \(([^)]*)\)", readme)
    assert said, "README 'Signals' no longer lists the keys that need a restart"
    listed = set(re.findall(r"`([a-z_.]+)`", said.group(1)))
    cfg = tmp_path / "m.toml"
    base = f'database_url = "{pg_dsn}"\nschema = "{schema}"\ninstance_id = "r1"\n'
    cfg.write_text(base + '[http]\nenabled = false\n')
    daemon = Daemon(load_settings(str(cfg)), config_path=str(cfg))
    try:
        cfg.write_text(base + '[http]\nenabled = true\nlisten = "127.0.0.1:0"\n')
        assert daemon.reload_from_file()
        assert any("needs a restart" in line and "keys=http" in line for line in maintd_log), maintd_log
        assert daemon.settings.http.enabled is False and daemon.http is None  # kept
    finally:
        daemon.stop()
    kept = {k for k in RESTART_ONLY if k != "http"} | {"http.listen", "http.enabled"}
    assert listed == kept, (listed, kept)


def test_a_reload_applies_metrics_max_periodic_ids_as_it_does_max_queues(pg_dsn, schema, tmp_path, maintd_log):
    """metrics.max_periodic_ids bounds the periodic_id series (README "Metrics"), and a reload is not
    among the keys that need a restart (README "Signals"): it applies, as metrics.max_queues does.
    A reload logged "config reloaded" and the per-periodic-entry bound stayed what the daemon
    started with, unsaid (each target's Metrics, which the enqueuer's observe reads)."""
    cfg = tmp_path / "m.toml"
    base = f'database_url = "{pg_dsn}"\ninstance_id = "r1"\n[http]\nenabled = false\n'
    targets = f'[[targets]]\nschema = "{schema}"\n[[targets]]\nname = "other"\nschema = "{schema}_b"\n'
    cfg.write_text(base + targets)
    daemon = Daemon(load_settings(str(cfg)), config_path=str(cfg))
    try:
        assert [t.metrics.max_periodic_ids for t in daemon.targets] == [100, 100]
        cfg.write_text(base + "[metrics]\nmax_queues = 4\nmax_periodic_ids = 3\n" + targets)
        assert daemon.reload_from_file()
        assert not any("needs a restart" in line for line in maintd_log), maintd_log
        assert [t.metrics.max_queues for t in daemon.targets] == [4, 4]
        assert [t.metrics.max_periodic_ids for t in daemon.targets] == [3, 3]
    finally:
        daemon.stop()
