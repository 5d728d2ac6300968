"""The crontab file in the config (SPEC 7.8): loaded relative to the config file, errors naming the
file and line, one id space with ``[[periodic]]``, ``_cron`` args, job key modes, reload, and bad
entries stopped at load or contained at run time."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from maintd.cli import main
from maintd.clock import FrozenClock
from maintd.config import ConfigError, load_settings
from maintd.daemon import Daemon
from maintd.jobs import JobQueue
from maintd.queries import sql
from maintd.services.base import PassContext
from maintd.services.periodic import PeriodicEnqueuer

UTC = timezone.utc
T0 = datetime(2026, 3, 2, 4, 0, tzinfo=UTC)


def write_config(tmp_path, dsn, schema, crontab: str, extra: str = "") -> str:
    (tmp_path / "jobs.crontab").write_text(crontab)
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{dsn}"\nschema = "{schema}"\ncrontab = "jobs.crontab"\n{extra}')
    return str(cfg)


def one_pass(settings, engine, when, service=None):
    service = service or PeriodicEnqueuer(settings.periodic_entries)
    return service.run_once(PassContext.for_settings(settings, engine, FrozenClock(when))), service


def jobs(engine, schema, kind=None):
    with engine.connect() as conn:
        return conn.execute(sql("SELECT id, kind, args, scheduled_at, state::text AS state FROM {schema}.jobs "
                                "WHERE CAST(:k AS text) IS NULL OR kind = :k ORDER BY scheduled_at, id", schema),
                            {"k": kind}).all()


def test_crontab_entries_are_loaded_relative_to_the_config_and_listed_by_check_config(
        tmp_path, pg_dsn, schema, capsys):
    cfg = write_config(tmp_path, pg_dsn, schema, "# nightly\n0 4 * * * send_emails ?fill=1d&max=10 {count: 5}\n"
                                                 "*/15 * * * * nested/task ?id=_private_id&queue=mail\n")
    settings = load_settings(cfg)
    [a, b] = [e for e in settings.periodic_entries]
    assert (a.id, a.kind, a.schedule, a.max_attempts, a.backfill, a.args) == (
        "send_emails", "send_emails", "0 4 * * *", 10, timedelta(days=1), {"count": 5})
    assert (b.id, b.kind, b.queue) == ("_private_id", "nested/task", "mail")
    assert main(["--config", cfg, "check-config"]) == 0
    listed = json.loads(capsys.readouterr().out)["crontab_entries"]
    assert [e["id"] for e in listed] == ["send_emails", "_private_id"]
    assert listed[0]["line"].endswith("jobs.crontab:2")


@pytest.mark.parametrize("crontab, message", [
    ("0 4 * * * ok\n\n61 4 * * * bad\n", "jobs.crontab:3: minute 61 out of range"),
    ("0 4 * * * task ?nope=1\n", "jobs.crontab:1:"),
    ("0 0 30 2 * never\n", "jobs.crontab:1:"),
    ("0 4 * * * dup\n5 4 * * * dup\n", "jobs.crontab:2: duplicate id"),
])
def test_bad_crontab_lines_are_config_errors_naming_file_and_line(tmp_path, pg_dsn, schema, crontab, message):
    cfg = write_config(tmp_path, pg_dsn, schema, crontab)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert message in str(err.value), str(err.value)
    assert str(err.value).startswith("crontab:")
    assert main(["--config", cfg, "check-config"]) == 2


def test_a_targets_periodic_id_that_is_also_a_crontab_lines_is_a_config_error(tmp_path, pg_dsn, schema):
    """A target's own [[targets.periodic]] list shares its ids with the crontab's lines, as the
    top-level list does; the clash was accepted, and one of the two never enqueued."""
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * task ?id=a\n",
                       f'[[targets]]\nschema = "{schema}"\n[[targets.periodic]]\nid = "a"\n'
                       'schedule = "@hourly"\nkind = "other"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert "targets[0].periodic: id 'a' is also a crontab line's (" in str(err.value)
    assert "jobs.crontab:1)" in str(err.value) and f"(target {schema})" in str(err.value)


def test_every_bad_crontab_line_is_a_config_error_of_its_own(tmp_path, pg_dsn, schema):
    """Issue 28: only the first bad line was reported."""
    cfg = write_config(tmp_path, pg_dsn, schema, "-90 * * * * a\n0 4 * * * ok\n* * * * * b.c\n* * * * * d {x\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    problems = err.value.problems
    assert [p.split(": ", 2)[1].rsplit(":", 1)[1] for p in problems] == ["1", "3", "4"], problems
    assert all(p.startswith("crontab: ") for p in problems)


def test_crontab_and_periodic_share_one_id_space(tmp_path, pg_dsn, schema):
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * report\n",
                       '[[periodic]]\nid = "report"\nschedule = "@hourly"\nkind = "r"\n')
    with pytest.raises(ConfigError, match=r"jobs.crontab:1: id 'report' is also a \[\[periodic\]\]"):
        load_settings(cfg)


def test_a_never_firing_periodic_schedule_is_rejected_at_load(tmp_path, pg_dsn, schema):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n'
                   '[[periodic]]\nid = "feb30"\nschedule = "0 0 30 2 *"\nkind = "k"\n')
    with pytest.raises(ConfigError, match=r"periodic\[0\] \(id='feb30'\).*never fires"):
        load_settings(str(cfg))


def test_jobs_get_the_payload_and_cron_metadata(tmp_path, pg_dsn, schema, engine):
    settings = load_settings(write_config(tmp_path, pg_dsn, schema, "0 * * * * hourly ?fill=3h {a: [1, 2]}\n"))
    _, service = one_pass(settings, engine, T0 - timedelta(hours=3))  # the baseline, 3 hours ago
    one_pass(settings, engine, T0, service)
    got = jobs(engine, schema, "hourly")
    assert [j.scheduled_at for j in got] == [T0 - timedelta(hours=2), T0 - timedelta(hours=1), T0]
    assert got[0].args == {"a": [1, 2], "_cron": {"ts": "2026-03-02T02:00:00.000Z", "backfilled": True}}
    assert got[-1].args["_cron"] == {"ts": "2026-03-02T04:00:00.000Z", "backfilled": False}


@pytest.mark.both_layouts  # the UPDATE-then-INSERT of queries.jobs.ENQUEUE_REPLACING (SPEC 8.1)
@pytest.mark.parametrize("mode, keeps_run_at", [("replace", False), ("preserve_run_at", True)])
def test_job_key_modes_update_the_waiting_job(tmp_path, pg_dsn, schema, engine, mode, keeps_run_at):
    settings = load_settings(write_config(
        tmp_path, pg_dsn, schema, f"0 * * * * sync ?jobKey=sync-all&jobKeyMode={mode} {{v: 2}}\n"))
    later = datetime(2099, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:  # a waiting job already holds the key
        JobQueue(schema).enqueue(conn, "sync", {"v": 1}, scheduled_at=later, unique_key="sync-all")
    _, service = one_pass(settings, engine, T0 - timedelta(minutes=1))
    result, _ = one_pass(settings, engine, T0, service)
    [job] = jobs(engine, schema, "sync")
    assert job.args["v"] == 2 and job.args["_cron"]["ts"] == "2026-03-02T04:00:00.000Z"
    # No job was enqueued: the slot went to the waiting one (it was counted as enqueued).
    assert result.enqueued == [] and result.skipped == {"sync": {"replaced": 1}}, result
    assert result.summary() == "enqueued 0 jobs ids=- skipped=1"
    assert (job.scheduled_at == later) is keeps_run_at
    assert job.state == ("scheduled" if keeps_run_at else "available")


@pytest.mark.parametrize("mode", ["replace", "preserve_run_at"])
def test_job_key_modes_leave_a_running_job_holding_the_key_alone(tmp_path, pg_dsn, schema, engine, mode):
    """A worker runs the job holding the key when the next slot comes: the slot is taken and
    counted as a duplicate, and the running job is not touched (had it been flipped back to
    available with the new args, a second worker would claim it while the first still runs it,
    and the first one's completion would be refused). graphile-worker's job_key_mode "replace"
    "overwrites the unlocked job" (website/docs/job-key.md); a running job is a locked one."""
    settings = load_settings(write_config(
        tmp_path, pg_dsn, schema, f"0 * * * * sync ?jobKey=sync-all&jobKeyMode={mode} {{v: 2}}\n"))
    q = JobQueue(schema)
    with engine.begin() as conn:
        q.enqueue(conn, "sync", {"v": 1}, unique_key="sync-all")
    with engine.begin() as conn:
        [running] = q.claim(conn, "default", "worker-1")
    with engine.connect() as conn:
        before = conn.execute(sql("SELECT to_jsonb(j) FROM {schema}.jobs j", schema)).scalar_one()
    _, service = one_pass(settings, engine, T0 - timedelta(minutes=1))  # the baseline
    result, _ = one_pass(settings, engine, T0, service)
    assert result.enqueued == [] and result.skipped == {"sync": {"duplicate": 1}}
    with engine.connect() as conn:
        after = conn.execute(sql("SELECT to_jsonb(j) FROM {schema}.jobs j", schema)).scalar_one()
        taken = conn.execute(sql("SELECT slot, job_id FROM {schema}.periodic_slots"
                                 " WHERE periodic_id = 'sync' ORDER BY slot", schema)).all()
    assert after == before and after["state"] == "running" and after["args"] == {"v": 1}
    assert taken[-1] == (T0, None)  # the slot is spent: it does not fire again when the key frees
    with engine.begin() as conn:
        assert q.complete(conn, running)  # the worker's completion still counts


def test_a_failing_entry_does_not_starve_the_others(pg_dsn, schema, engine, settings):
    s = settings.model_copy(update={"periodic": []})
    s = load_settings(None, database_url=pg_dsn, schema=schema, periodic=[
        {"id": "broken", "schedule": "* * * * *", "kind": "b", "run_on_start": True},
        {"id": "healthy", "schedule": "@every 10s", "kind": "h", "run_on_start": True}])

    class Broken(PeriodicEnqueuer):
        def schedule(self, job):
            if job.id == "broken":
                raise RuntimeError("cannot compute this entry's slots")
            return super().schedule(job)

    service = Broken(s.periodic_entries)
    for i in range(3):
        result, _ = one_pass(s, engine, T0 + timedelta(seconds=10 * i), service)
        assert "broken" in result.errors and result.failed()
        assert result.skipped["broken"]["error"] == 1
    assert [j.scheduled_at for j in jobs(engine, schema, "h")] == [T0 + timedelta(seconds=10 * i) for i in range(3)]


def test_sighup_reloads_the_crontab_file(tmp_path, pg_dsn, schema, capsys):
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * first\n", '[http]\nenabled = false\n')
    daemon = Daemon(load_settings(cfg), config_path=cfg)
    assert [e.id for e in daemon.targets[0].runner.services["periodic"].config] == ["first"]
    (tmp_path / "jobs.crontab").write_text("0 4 * * * first\n0 5 * * * second\n")
    assert daemon.reload_from_file()
    assert [e.id for e in daemon.targets[0].runner.services["periodic"].config] == ["first", "second"]
    # Issue 28: the line said periodic=0 while crontab entries were active.
    reloaded = [line for line in capsys.readouterr().err.splitlines() if "config reloaded" in line]
    assert reloaded and reloaded[-1].endswith("periodic=2 periodic_config=0 crontab=2"), reloaded
    (tmp_path / "jobs.crontab").write_text("0 4 * * * first\n99 5 * * * broken\n")
    assert not daemon.reload_from_file()  # rejected: the old entries stay
    assert [e.id for e in daemon.targets[0].runner.services["periodic"].config] == ["first", "second"]
    daemon.stop()


@pytest.mark.parametrize("crontab, message", [
    ("0 4 * * * task {a: 'x\\u0000'}\n", "jobs.crontab:1: payload: a holds a NUL character"),
    ("0 4 * * * task {'a\\u0000': 1}\n", "jobs.crontab:1: payload: key 'a\\x00' holds a NUL character"),
    ("0 4 * * * task ?jobKey=a%00b\n", "jobs.crontab:1: jobKey: holds a NUL character"),
])
def test_a_crontab_line_postgresql_cannot_store_names_the_line_and_option(tmp_path, crontab, message, capsys):
    """Loaded, then every slot failed ("unsupported Unicode escape sequence", "PostgreSQL text
    fields cannot contain NUL (0x00) bytes"), as NaN in a payload is refused at load already."""
    cfg = write_config(tmp_path, "postgresql://u@db.invalid/app", "maintd", crontab)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert message in str(err.value), str(err.value)
    assert main(["--config", cfg, "check-config"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_payload_nested_too_deeply_is_a_config_error_naming_the_line(tmp_path, capsys):
    """It exited 1 with "maximum recursion depth exceeded while calling a Python object"."""
    cfg = write_config(tmp_path, "postgresql://u@db.invalid/app", "maintd",
                       "0 4 * * * ok\n0 4 * * * task " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert "jobs.crontab:2: invalid JSON5 payload: nested too deeply" in str(err.value), str(err.value)
    assert main(["--config", cfg, "check-config"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_line_postgresql_cannot_store_is_reported_with_every_other_bad_line(tmp_path, capsys):
    """Issue 28 again: a payload or jobKey holding NUL (checked as a periodic entry) was reported
    only when no line had a syntax error, and then only the first such line."""
    cfg = write_config(tmp_path, "postgresql://u@db.invalid/app", "maintd",
                       "0 4 * * * a ?jobKey=%00\n0 4 * * * b {x: '\\u0000'}\n0 4 * * * ok\n"
                       "61 4 * * * c\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    lines = [p.split(": ", 2)[1].rsplit(":", 1)[1] for p in err.value.problems]
    assert lines == ["1", "2", "4"], err.value.problems
    assert "jobs.crontab:1: jobKey: holds a NUL character" in str(err.value)
    assert "jobs.crontab:2: payload: x holds a NUL character" in str(err.value)
    assert main(["--config", cfg, "check-config"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_relative_crontab_path_from_the_environment_is_relative_to_the_config_file(
        tmp_path, pg_dsn, schema, monkeypatch):
    """SPEC 4 and 7.8: ``MAINTD_CRONTAB`` overrides the key ``crontab``, which is relative to the
    config file. The variable's relative path was read from the working directory (``/`` under
    systemd): 'crontab: jobs.crontab: cannot read crontab: No such file or directory'."""
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * from_file\n")
    (tmp_path / "other.crontab").write_text("0 5 * * * from_env\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("MAINTD_CRONTAB", "other.crontab")
    settings = load_settings(cfg)
    assert [e.id for e in settings.periodic_entries] == ["from_env"]
    assert settings.crontab == str(tmp_path / "other.crontab")


@pytest.mark.parametrize("how", ["file", "env"])
def test_an_empty_crontab_path_is_a_config_error_naming_the_key(tmp_path, pg_dsn, schema, monkeypatch, how):
    """``crontab = ""`` was read as the config file's directory ('crontab: .: cannot read crontab:
    Is a directory'), and an empty MAINTD_CRONTAB dropped the file's crontab without a word."""
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * nightly\n")
    if how == "file":
        (tmp_path / "maintd.toml").write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\ncrontab = ""\n')
    else:
        monkeypatch.setenv("MAINTD_CRONTAB", "")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    source = " (from MAINTD_CRONTAB)" if how == "env" else ""  # where the empty path came from
    assert err.value.problems == ["crontab: an empty path: leave the key out (and MAINTD_CRONTAB unset) for no "
                                  f"crontab file{source}"]


def test_the_crontab_reaches_every_target_also_one_whose_periodic_list_replaces_the_top_levels(
        tmp_path, pg_dsn, schema):
    """A target's ``periodic`` replaces the top-level [[periodic]] list; the crontab is a top-level
    key no target sets, so, like every such key, its lines are entries of every target, a target
    with a list of its own included (the README said only that the list is replaced). A reload
    of the crontab file reaches every target too."""
    other = f"{schema}_b"
    cfg = write_config(tmp_path, pg_dsn, schema, "0 4 * * * nightly\n",
                       '[http]\nenabled = false\n'
                       '[[periodic]]\nid = "top"\nschedule = "@hourly"\nkind = "t"\n'
                       f'[[targets]]\nschema = "{schema}"\n[[targets.periodic]]\nid = "own"\n'
                       'schedule = "@hourly"\nkind = "o"\n'
                       f'[[targets]]\nschema = "{other}"\n')
    settings = load_settings(cfg)
    assert [[e.id for e in t.periodic_entries] for t in settings.target_settings()] == \
        [["own", "nightly"], ["top", "nightly"]]
    daemon = Daemon(settings, config_path=cfg)
    try:
        (tmp_path / "jobs.crontab").write_text("0 4 * * * nightly\n0 5 * * * early\n")
        assert daemon.reload_from_file()
        assert [[e.id for e in t.runner.services["periodic"].config] for t in daemon.targets] == \
            [["own", "nightly", "early"], ["top", "nightly", "early"]]
    finally:
        daemon.stop()
