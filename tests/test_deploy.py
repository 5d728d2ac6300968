"""deploy/: systemd units, Kubernetes manifests, Prometheus rules, Grafana dashboard, Dockerfile.

The deploy files are also run: their commands, parsed out of the files, with an owner role for the
migration steps and a runtime role (given exactly ``maintd grants``) for the daemon, on a real
server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml

from maintd.config import load_settings
from maintd.metrics import Metrics

from .conftest import example_lines
from .procs import wait_for
from .tools import require

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MAINTD_BIN = str(Path(sys.executable).parent / "maintd")
# Names the deploy files use for what a test replaces with its own.
DEPLOY_CONFIG, DEPLOY_BINARIES = "/etc/maintd/maintd.toml", ("/opt/maintd/bin/maintd", "maintd")
OWNER_ROLE, RUNTIME_ROLE = "maintd_owner", "maintd_daemon"


def metric_names() -> set[str]:
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for metric in Metrics().registry.collect():
        names.update(metric.name + suffix for suffix in suffixes[metric.type])
    return names


def referenced_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(maintd_[a-z_]+)\b", expr))


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def test_systemd_units_verify(tmp_path):
    daemon = (DEPLOY / "systemd" / "maintd.service").read_text()
    assert "Type=notify" in daemon and "DynamicUser=yes" in daemon and "NoNewPrivileges=yes" in daemon
    assert "ExecReload=/bin/kill -HUP $MAINPID" in daemon and "WatchdogSec=" in daemon
    # systemd's default soft limit (1,024) is about as many idle connections (issue 26)
    assert int(unit_values(parse_unit(DEPLOY / "systemd" / "maintd.service"), "Service", "LimitNOFILE")[0]) >= 8192
    analyze = require("systemd-analyze")
    copies = []
    for unit in ("maintd.service", "maintd-migrate.service"):
        copy = tmp_path / unit
        copy.write_text((DEPLOY / "systemd" / unit).read_text().replace(DEPLOY_BINARIES[0], MAINTD_BIN))
        copies.append(str(copy))
    res = subprocess.run([analyze, "verify", *copies], capture_output=True, text=True)
    problems = [line for line in res.stderr.splitlines() if "maintd" in line]
    assert res.returncode == 0 and problems == [], res.stderr


def test_systemd_daemon_unit_runs_no_migration_as_the_runtime_role():
    daemon = parse_unit(DEPLOY / "systemd" / "maintd.service")
    migrate = parse_unit(DEPLOY / "systemd" / "maintd-migrate.service")
    assert unit_values(daemon, "Service", "ExecStartPre") == []
    [start] = unit_values(daemon, "Service", "ExecStart")
    assert shlex.split(start)[-1] == "run"
    assert "maintd-migrate.service" in " ".join(unit_values(daemon, "Unit", "Wants")).split()
    assert "maintd-migrate.service" in " ".join(unit_values(daemon, "Unit", "After")).split()
    assert unit_values(migrate, "Service", "Type") == ["oneshot"]
    assert unit_values(migrate, "Service", "EnvironmentFile") != unit_values(daemon, "Service", "EnvironmentFile")


def test_systemd_does_not_restart_a_daemon_its_config_stops():
    """Exit 2 is a bad configuration (README: exit codes), which no restart mends: the unit
    restarted it ten times in 20 s, filling the journal with the same error, then gave up with
    'start request repeated too quickly', which hid it. systemd.service(5), RestartPreventExitStatus=."""
    daemon = parse_unit(DEPLOY / "systemd" / "maintd.service")
    assert unit_values(daemon, "Service", "Restart") == ["on-failure"]
    assert "2" in " ".join(unit_values(daemon, "Service", "RestartPreventExitStatus")).split()


def k8s_docs():
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def test_kubernetes_manifests_validate():
    import kubernetes_validate

    version = kubernetes_validate.utils.latest_version()
    kinds = set()
    for name, doc in k8s_docs():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            spec = doc["spec"]  # a CRD: check what Prometheus Operator needs
            assert spec["selector"]["matchLabels"] and spec["podMetricsEndpoints"][0]["port"] == "http"
            continue
        if doc["kind"] == "Kustomization":
            for res in doc["resources"]:
                assert (DEPLOY / "kubernetes" / res).exists(), res
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    assert {"Deployment", "ConfigMap", "PodDisruptionBudget", "Service", "PodMonitor", "Kustomization",
            "NetworkPolicy"} <= kinds


def test_only_prometheus_reaches_the_http_port_in_kubernetes():
    """The port listens on the pod's address and serves /status and /jobs/ID (a job's args) with
    no token by default: a NetworkPolicy admits only the monitoring namespace to it (the
    kubelet's probes come from the node, which a NetworkPolicy never blocks)."""
    docs = dict((d["kind"], d) for _, d in k8s_docs())
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"]
    [source] = rule["from"]
    assert set(source) == {"namespaceSelector"} and source["namespaceSelector"]["matchLabels"]
    assert docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_deployment_shape():
    dep = next(d for _, d in k8s_docs() if d["kind"] == "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    [c] = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["envFrom"][0]["secretRef"]["name"] == "maintd-database"
    # instance_id is left to the default, which fits any pod name (test_config's
    # test_the_default_instance_id_fits_whatever_the_host_name); the pod name set explicitly
    # failed the 48-character check for a Deployment name over about 30 characters.
    assert "MAINTD_INSTANCE_ID" not in {e["name"] for e in c.get("env", [])}
    assert [i["args"][-1] for i in pod["initContainers"]] == ["migrate", "--apply"]
    assert {i["envFrom"][0]["secretRef"]["name"] for i in pod["initContainers"]} == {"maintd-database-owner"}


def test_pod_disruption_budget_lets_a_drain_evict_pods_that_are_not_ready():
    """/readyz is 503 on every replica while the database is unreachable or read-only (a primary
    failover, an outage) or the schema is behind. With the default unhealthyPodEvictionPolicy
    (IfHealthyBudget) a not-ready pod is evicted only while the budget's minimum of ready pods
    holds, so a node drain during such an outage waited until the database came back."""
    pdb = next(d for _, d in k8s_docs() if d["kind"] == "PodDisruptionBudget")["spec"]
    dep = next(d for _, d in k8s_docs() if d["kind"] == "Deployment")
    assert pdb["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert pdb.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", \
        "pdb.yaml: a drain is blocked while no maintd pod is ready (database down or read-only)"


def example_secrets() -> dict[str, str]:
    """Secret name -> the role its example DSN logs in as."""
    out = {}
    for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "secret.example.yaml").read_text()):
        url = doc["stringData"]["MAINTD_DATABASE_URL"]
        out[doc["metadata"]["name"]] = re.match(r"postgresql://([^:@/]+)", url).group(1)
    return out


def test_secret_examples_name_an_owner_and_a_runtime_role():
    assert example_secrets() == {"maintd-database-owner": OWNER_ROLE, "maintd-database": RUNTIME_ROLE}


def test_configmap_toml_is_a_valid_maintd_config(tmp_path):
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap")
    p = tmp_path / "maintd.toml"
    p.write_text(cm["data"]["maintd.toml"])
    settings = load_settings(p)
    assert settings.http.listen == "0.0.0.0:9464" and settings.log.format == "json"


def service_link_variables(name: str, ports: list[dict]) -> dict[str, str]:
    """What the kubelet puts in the environment of every pod of a namespace for a Service (the
    "service links", on unless the pod says enableServiceLinks: false)."""
    prefix, out = name.upper().replace("-", "_"), {}
    out[f"{prefix}_SERVICE_HOST"], out[f"{prefix}_SERVICE_PORT"] = "10.0.0.7", str(ports[0]["port"])
    out[f"{prefix}_PORT"] = f"tcp://10.0.0.7:{ports[0]['port']}"
    for port in ports:
        if "name" in port:
            out[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        tcp = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        out.update({tcp: f"tcp://10.0.0.7:{port['port']}", f"{tcp}_PROTO": "tcp", f"{tcp}_PORT": str(port["port"]),
                    f"{tcp}_ADDR": "10.0.0.7"})
    return out


@pytest.mark.parametrize("service", ["maintd", "maintd-metrics"])
def test_the_pods_start_beside_the_service_variables_kubernetes_gives_them(tmp_path, monkeypatch, service):
    """service.yaml's Service is named maintd: the kubelet gives every pod created after it
    MAINTD_SERVICE_HOST, MAINTD_PORT_9464_TCP and the like, which the daemon refused as unknown
    settings (exit 2: every pod of the Deployment in CrashLoopBackOff)."""
    svc = next(d for _, d in k8s_docs() if d["kind"] == "Service")
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap")
    p = tmp_path / "maintd.toml"
    p.write_text(cm["data"]["maintd.toml"])
    for name in [k for k in os.environ if k.startswith("MAINTD_")]:
        monkeypatch.delenv(name)
    for key, value in service_link_variables(service if service != "maintd" else svc["metadata"]["name"],
                                             svc["spec"]["ports"]).items():
        monkeypatch.setenv(key, value)
    assert load_settings(p).http.listen == "0.0.0.0:9464"
    monkeypatch.setenv("MAINTD_CLEANR__ENABLED", "false")  # a typo is still one
    with pytest.raises(Exception, match="MAINTD_CLEANR__ENABLED: unknown environment setting"):
        load_settings(p)


# SPEC 7.3's counter, registered by the metrics of the second round.
ANNOUNCED_METRICS = {"maintd_rows_skipped_total"}
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_prometheus_rules():
    known = metric_names() | ANNOUNCED_METRICS
    names = set()
    for rule in alert_rules():
        assert set(rule) >= {"alert", "expr", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        unknown = referenced_metrics(rule["expr"]) - known
        assert not unknown, f"{rule['alert']}: unknown metrics {unknown}"
        # Per target: every aggregation keeps the target label (absent() has none to keep).
        for by in re.findall(r"\b(?:sum|max|min|count|avg)\s+by\s*\(([^)]*)\)", rule["expr"]):
            assert "target" in [label.strip() for label in by.split(",")], (rule["alert"], by)
        assert re.search(r"\b(?:sum|max|min|count|avg)\s*\(", rule["expr"]) is None, rule["alert"]
        names.add(rule["alert"])
    assert {"MaintdNoLeader", "MaintdTwoLeaders", "MaintdServiceFailing", "MaintdServiceStalled",
            "MaintdRescuedJobsRising", "MaintdBacklogAgeGrowing", "MaintdReindexFailed",
            "MaintdRowsSkipped"} <= names


def promtool() -> str:
    """promtool where .ci/run installs it (a skip, or under CI=true a failure, without it)."""
    return require("promtool")


def test_alerts_pass_promtool_check_and_unit_tests():
    tool = promtool()
    res = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([tool, "test", "rules", ALERT_TESTS.name], cwd=ALERT_TESTS.parent,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_every_metric_passes_promtool_check_metrics():
    """Prometheus' own linter of the exposition format and its naming conventions
    (promtool's ``check metrics``, cmd/promtool/metrics.go, and the client_golang ``testutil/promlint``
    rules it runs: counters end in ``_total``, units are base units in the name, no reserved
    suffixes on gauges, HELP on every family). Every family maintd registers, each with a series
    (a family without one is not exposed at all)."""
    from prometheus_client import generate_latest

    tool = promtool()
    metrics = Metrics(target="shop")
    for family, metric in metrics._families.values():
        bound = metrics[family]
        if family.labels and not bound.children():
            bound.labels(*("x" for _ in family.labels))
    exposition = generate_latest(metrics.registry)
    families = exposition.decode().count("# TYPE ")
    assert families >= 25, exposition.decode()
    res = subprocess.run([tool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), \
        (res.stdout + res.stderr).decode()


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    cases: dict[str, set[bool]] = {}
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            cases.setdefault(check["alertname"], set()).add(bool(check.get("exp_alerts")))
    missing = {rule["alert"]: {True, False} - cases.get(rule["alert"], set()) for rule in alert_rules()}
    assert not {name: m for name, m in missing.items() if m}, "alerts without a firing (True) or quiet (False) test"


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "maintd.json").read_text())


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def test_grafana_dashboard_uses_known_metrics():
    known = metric_names() | ANNOUNCED_METRICS
    used = set()
    for expr in dashboard_exprs():
        used |= referenced_metrics(expr)
    assert not used - known, used - known
    spec_metrics = {"maintd_is_leader", "maintd_leadership_changes_total", "maintd_service_runs_total",
                    "maintd_service_run_seconds_bucket", "maintd_service_last_success_timestamp_seconds",
                    "maintd_jobs_deleted_total", "maintd_jobs_rescued_total", "maintd_jobs_promoted_total",
                    "maintd_periodic_enqueued_total", "maintd_periodic_skipped_total", "maintd_reindex_total",
                    "maintd_jobs", "maintd_oldest_available_job_age_seconds", "maintd_rows_skipped_total"}
    assert spec_metrics <= used


def test_grafana_dashboard_filters_every_query_by_target():
    [var] = [v for v in dashboard()["templating"]["list"] if v["name"] == "target"]
    assert var["type"] == "query" and var["multi"] and var["includeAll"] and var["allValue"] == ".*"
    assert re.fullmatch(r"label_values\(maintd_\w+, *target\)", var["query"]["query"]), var["query"]
    exprs = dashboard_exprs()
    assert exprs
    for expr in exprs:  # every selector of every query, not just somewhere in the expression
        selectors = re.findall(r"\b(maintd_[a-z_]+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for metric, matchers in selectors:
            assert 'target=~"$target"' in matchers, f"{metric} in {expr!r} is not filtered by $target"
        for by in re.findall(r"\bby\s*\(([^)]*)\)", expr):  # and series of two targets never merge
            assert "target" in [label.strip() for label in by.split(",")], expr


def test_grafana_panels_carry_the_unit_of_what_they_plot():
    """Grafana formats an axis by the panel's unit (grafana/packages/grafana-data/src/valueFormats/
    categories.ts: 's' shows 7200 as '2 hour', 'bytes' as MiB, 'short' with SI suffixes): a
    seconds panel without one showed '7.2 K'. A rate's panel says '/ s' in its title."""
    for panel in dashboard()["panels"]:
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        exprs = " ".join(t["expr"] for t in panel["targets"])
        assert unit, f"panel {panel['title']!r} has no unit"
        if re.search(r"_seconds(_bucket)?\{|\btime\(\) -", exprs):
            assert unit == "s", (panel["title"], unit)
        elif "_bytes{" in exprs:
            assert unit == "bytes", (panel["title"], unit)
        else:
            assert unit in ("short", "none"), (panel["title"], unit)
        if unit == "short" and "rate(" in exprs and "increase(" not in exprs:  # a count's rate
            assert "/ s" in panel["title"], panel["title"]


def test_dockerfile_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["maintd"]' in text


# -- reproducible installs: requirements.lock ------------------------------------------------------

def lock_pins() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock as {normalized name: (version, hashes)}."""
    text = (ROOT / "requirements.lock").read_text()
    pins = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", block)
        if m:
            pins[canonical(m.group(1))] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> set[str]:
    """maintd's runtime dependencies, transitively, for this interpreter (no extras)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    seen, todo = set(), ["maintd"]
    while todo:
        for spec in requires(todo.pop()) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonical(req.name)
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_lock_pins_the_whole_runtime_closure_with_hashes():
    import tomllib

    from packaging.requirements import Requirement

    pins = lock_pins()
    assert runtime_closure() <= set(pins), runtime_closure() - set(pins)
    assert all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"]:  # a stale lock no longer satisfies pyproject
        req = Requirement(spec)
        version, _ = pins[canonical(req.name)]
        assert req.specifier.contains(version, prereleases=True), (spec, version)


def dockerfile_build_stage() -> tuple[str, list[tuple[str, str]], list[str]]:
    """(WORKDIR, COPY (source, destination) pairs, RUN commands) of the Dockerfile's first stage."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stage = re.split(r"^FROM ", text, flags=re.M)[1]
    workdir = re.search(r"^WORKDIR\s+(\S+)", stage, re.M).group(1)
    copies = [(src, args.split()[-1]) for args in re.findall(r"^COPY\s+(\S.*)$", stage, re.M)
              for src in args.split()[:-1]]
    return workdir, copies, re.findall(r"^RUN\s+(.+)$", stage, re.M)


def test_dockerfile_installs_from_the_lock():
    _, copies, runs = dockerfile_build_stage()
    assert copies[0][0] == "requirements.lock"  # its layer is cached until the lock changes
    commands = " && ".join(runs)
    assert "--require-hashes -r requirements.lock" in commands and "install --no-cache-dir --no-deps ." in commands
    assert "pip check" in commands


@pytest.mark.slow
def test_dockerfile_build_stage_installs_a_working_maintd(tmp_path):
    """The build stage's COPY and RUN steps, run here (no container engine needed): a venv with
    exactly the locked, hash-checked dependencies and maintd, whose `pip check` passes."""
    workdir, copies, runs = dockerfile_build_stage()
    context, prefix = tmp_path / "src", str(tmp_path / "opt-maintd")
    context.mkdir()
    for src, dest in copies:
        target = context / dest.removeprefix(workdir).strip("/").removeprefix("./")
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, context if dest.endswith("/") else target)
    python = shutil.which("python3.11") or sys.executable
    for command in runs:
        command = command.replace("/opt/maintd", prefix).replace("python -m venv", f"{python} -m venv")
        res = subprocess.run(["bash", "-ec", command], cwd=context, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (command, res.stdout[-2000:], res.stderr[-2000:])
    res = subprocess.run([f"{prefix}/bin/maintd", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("maintd "), res.stderr
    frozen = subprocess.run([f"{prefix}/bin/pip", "freeze", "--exclude", "maintd"], capture_output=True,
                            text=True).stdout
    installed = {canonical(n): v for n, v in re.findall(r"^(\S+)==(\S+)$", frozen, re.M)}
    pins = lock_pins()
    assert installed == {n: pins[n][0] for n in installed} and set(installed) <= set(pins)


# -- the deploy files, run end to end with an owner and a runtime role ------------------------------

@dataclass
class Roles:
    schema: str
    owner: str
    runtime: str
    dsn: dict[str, str]  # role kind (OWNER_ROLE / RUNTIME_ROLE) -> its DSN


@pytest.fixture
def deploy_roles(pg_dsn):
    """An owner role owning an empty schema (the administrator's only DDL, as the README says) and
    a runtime role with no privilege at all yet."""
    suffix = uuid.uuid4().hex[:8]
    r = Roles(f"t_deploy_{suffix}", f"maintd_owner_{suffix}", f"maintd_daemon_{suffix}", {})
    assert "postgres@" in pg_dsn
    r.dsn = {OWNER_ROLE: pg_dsn.replace("postgres@", f"{r.owner}@", 1),
             RUNTIME_ROLE: pg_dsn.replace("postgres@", f"{r.runtime}@", 1)}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{r.owner}" LOGIN')
        conn.execute(f'CREATE ROLE "{r.runtime}" LOGIN')
        conn.execute(f'CREATE SCHEMA "{r.schema}" AUTHORIZATION "{r.owner}"')
    try:
        yield r
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename IN (%s, %s)",
                         (r.owner, r.runtime))
            for role in (r.runtime, r.owner):  # the owner's objects (the schema) go last
                conn.execute(f'DROP OWNED BY "{role}" CASCADE')
                conn.execute(f'DROP ROLE "{role}"')


def localize(argv: list[str], config: Path, roles: Roles) -> list[str]:
    """A deploy file's command for this machine: our maintd, our config file, our runtime role."""
    out = [MAINTD_BIN if argv[0] in DEPLOY_BINARIES else argv[0]]
    replace = {DEPLOY_CONFIG: str(config), RUNTIME_ROLE: roles.runtime}
    return out + [replace.get(a, a) for a in argv[1:]]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAINTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    return {**env, **extra}


def run_steps(steps: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    outputs = []
    for argv, env in steps:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env(env))
        assert res.returncode == 0, (argv, res.stdout + res.stderr)
        outputs.append(res.stdout)
    return outputs


def seed_expired(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, state, attempt, attempted_at, finalized_at)
                         VALUES ('deploy.old', 'completed', 1, now() - interval '3 days', now() - interval '2 days')""")


def run_daemon_until_it_cleans(pg_dsn: str, roles: Roles, argv: list[str], env: dict[str, str],
                               log_path: Path, probes: tuple[str, ...] = ()) -> None:
    """Start the daemon as the runtime role; it must lead and run a successful cleaner pass that
    deletes the expired row; the probes answer 200; SIGTERM ends it with 0."""
    seed_expired(pg_dsn, roles.schema)
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(env))
    try:
        def cleaned():
            with psycopg.connect(pg_dsn) as conn:
                row = conn.execute(
                    f"""SELECT r.outcome, r.finished_at > to_timestamp(%s),
                               NOT EXISTS (SELECT 1 FROM "{roles.schema}".jobs WHERE kind = 'deploy.old'),
                               (SELECT a.usename FROM "{roles.schema}".leader l
                                  JOIN pg_stat_activity a ON a.pid = l.backend_pid)
                          FROM "{roles.schema}".service_runs r WHERE r.service = 'cleaner'""",
                    (started,)).fetchone()
            assert proc.poll() is None, log_path.read_text()
            return row if row and row[1] and row[2] else None

        outcome, _, _, leader_role = wait_for(cleaned, 30, interval=0.2, what="a cleaner pass")
        assert (outcome, leader_role) == ("success", roles.runtime), log_path.read_text()
        # text (address=H:P) or JSON ("address": "H:P") logs
        port = re.search(r'http listening.*?address\W+[\d.]+:(\d+)', log_path.read_text()).group(1)
        for path in probes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                assert resp.status == 200, path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    log = log_path.read_text()
    assert code == 0 and "permission denied" not in log, log


@pytest.mark.slow
@pytest.mark.both_layouts
def test_systemd_units_deploy_with_an_owner_and_a_runtime_role(pg_dsn, deploy_roles, layout, tmp_path):
    """On the partitioned layout (SPEC 8.1) too: the owner's migrate builds the partitions and
    their functions, the runtime role (no DDL right) runs the partitioner and the cleaner."""
    r = deploy_roles
    daemon = parse_unit(DEPLOY / "systemd" / "maintd.service")
    migrate = parse_unit(DEPLOY / "systemd" / "maintd-migrate.service")
    # What each EnvironmentFile holds (the units' comments say which role): the owner's DSN for
    # the migration unit, the runtime role's for the daemon.
    [owner_env] = unit_values(migrate, "Service", "EnvironmentFile")
    [runtime_env] = unit_values(daemon, "Service", "EnvironmentFile")
    assert OWNER_ROLE in (DEPLOY / "systemd" / "maintd-migrate.service").read_text()
    assert RUNTIME_ROLE in (DEPLOY / "systemd" / "maintd.service").read_text()
    env_files = {owner_env: {"MAINTD_DATABASE_URL": r.dsn[OWNER_ROLE]},
                 runtime_env: {"MAINTD_DATABASE_URL": r.dsn[RUNTIME_ROLE]}}
    config = tmp_path / "maintd.toml"
    config.write_text(f'schema = "{r.schema}"\nlayout = "{layout}"\n[http]\nlisten = "127.0.0.1:0"\n'
                      '[cleaner]\ninterval = "1s"\n')
    # `systemctl start maintd`: the migrate unit's commands (Wants= + After=), then the daemon's.
    steps = [(localize(shlex.split(line), config, r), env_files[owner_env])
             for line in unit_values(migrate, "Service", "ExecStart")]
    first = run_steps(steps)
    assert "migrated from base" in first[0] and "granted role" in first[1]
    [start] = unit_values(daemon, "Service", "ExecStart")
    run_daemon_until_it_cleans(pg_dsn, r, localize(shlex.split(start), config, r), env_files[runtime_env],
                               tmp_path / "daemon.log")
    # A restart runs the migrate unit again: nothing to do, and so for the runtime role.
    assert "nothing to do" in run_steps(steps)[0]
    runtime_migrate = (localize(shlex.split(unit_values(migrate, "Service", "ExecStart")[0]), config, r),
                       env_files[runtime_env])
    assert "nothing to do" in run_steps([runtime_migrate])[0]


def container_env(container: dict, secrets: dict[str, str], roles: Roles) -> dict[str, str]:
    """The container's environment: its Secret's DSN (by the role the example Secret names) and
    its env entries (a fieldRef gets a pod-like value)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env["MAINTD_DATABASE_URL"] = roles.dsn[secrets[source["secretRef"]["name"]]]
    for item in container.get("env", []):
        env[item["name"]] = item.get("value") or "maintd-7d9f8b6c5-x2x7q"
    return env


@pytest.mark.slow
def test_kubernetes_pod_deploys_with_an_owner_and_a_runtime_role(pg_dsn, deploy_roles, tmp_path):
    r = deploy_roles
    pod = next(d for _, d in k8s_docs() if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap")
    config = tmp_path / "maintd.toml"
    config.write_text(cm["data"]["maintd.toml"])  # as mounted at /etc/maintd
    secrets = example_secrets()
    # Only what differs on this machine: the test's schema and a free port.
    local = {"MAINTD_SCHEMA": r.schema, "MAINTD_HTTP__LISTEN": "127.0.0.1:0"}
    init = [(localize(["maintd", *c["args"]], config, r), {**container_env(c, secrets, r), **local})
            for c in pod["initContainers"]]
    assert all(env["MAINTD_DATABASE_URL"] == r.dsn[OWNER_ROLE] for _, env in init)
    outputs = run_steps(init)
    assert "migrated from base" in outputs[0] and "granted role" in outputs[1]
    [main] = pod["containers"]
    env = {**container_env(main, secrets, r), **local}
    assert env["MAINTD_DATABASE_URL"] == r.dsn[RUNTIME_ROLE]
    probes = (main["readinessProbe"]["httpGet"]["path"], main["livenessProbe"]["httpGet"]["path"])
    run_daemon_until_it_cleans(pg_dsn, r, localize(["maintd", *main["args"]], config, r), env,
                               tmp_path / "daemon.log", probes)
    # The next pod's init containers: nothing to do.
    assert "nothing to do" in run_steps(init)[0]


# -- config.example.toml states the real defaults ----------------------------------------------------

PERIODIC_REQUIRED = {"id": "x", "schedule": "@hourly", "kind": "k"}


def configured(section: str, key: str | None = None, value=None):
    """The config object of a section (top level "", or the [[periodic]] entry), with ``key`` set
    to ``value`` (through validation) if given, else all defaults."""
    from maintd.config import PeriodicJob, Settings

    given = {} if key is None else {key: value}
    if section == "periodic":
        return PeriodicJob(**PERIODIC_REQUIRED, **given)
    settings = Settings(instance_id="x", **(given if section == "" else {section: given} if given else {}))
    return settings if section == "" else getattr(settings, section)


def test_example_config_states_the_real_defaults(monkeypatch):
    import tomllib

    for name in [k for k in os.environ if k.startswith("MAINTD_")]:
        monkeypatch.delenv(name)
    checked = 0
    for section, key, value, commented in example_lines():
        if section.startswith("cleaner.queues.") or (
                section not in ("", "periodic") and not hasattr(configured(""), section)) or (
                section != "periodic" and isinstance(getattr(configured(""), section, None), list)):
            continue  # per-queue overrides and other arrays of tables: examples by nature
        field = type(configured(section)).model_fields[key]
        default = getattr(configured(section), key)
        if field.is_required() or (commented and (default is None or key in ("instance_id", "args"))):
            continue  # an example of an optional key, or a computed default stated in its comment
        got = getattr(configured(section, key, tomllib.loads(f"v = {value}")["v"]), key)
        shown = default.get_secret_value() if hasattr(default, "get_secret_value") else default
        assert got == default, f"config.example.toml [{section}] {key} = {value}: the default is {shown!r}"
        checked += 1
    assert checked >= 30
