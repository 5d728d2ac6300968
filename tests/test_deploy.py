"""deploy/: systemd unit, Kubernetes manifests, Prometheus rules, Grafana dashboard, Dockerfile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from maintd.config import load_settings
from maintd.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def metric_names() -> set[str]:
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for metric in Metrics().registry.collect():
        names.update(metric.name + suffix for suffix in suffixes[metric.type])
    return names


def referenced_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(maintd_[a-z_]+)\b", expr))


def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "maintd.service").read_text()
    assert "Type=notify" in unit and "DynamicUser=yes" in unit and "NoNewPrivileges=yes" in unit
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit and "WatchdogSec=" in unit
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    maintd_bin = shutil.which("maintd") or str(Path(sys.executable).parent / "maintd")
    copy = tmp_path / "maintd.service"
    copy.write_text(unit.replace("/usr/local/bin/maintd", maintd_bin))
    res = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
    problems = [line for line in res.stderr.splitlines() if "maintd.service" in line]
    assert res.returncode == 0 and problems == [], res.stderr


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
    assert {"Deployment", "ConfigMap", "PodDisruptionBudget", "Service", "PodMonitor", "Kustomization"} <= kinds


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
    assert "migrate" in pod["initContainers"][0]["args"]


def test_configmap_toml_is_a_valid_maintd_config(tmp_path):
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap")
    p = tmp_path / "maintd.toml"
    p.write_text(cm["data"]["maintd.toml"])
    settings = load_settings(p)
    assert settings.http.listen == "0.0.0.0:9464" and settings.log.format == "json"


def test_prometheus_rules():
    known = metric_names()
    path = DEPLOY / "prometheus" / "alerts.yml"
    if shutil.which("promtool"):
        res = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    data = yaml.safe_load(path.read_text())
    names = set()
    for group in data["groups"]:
        for rule in group["rules"]:
            assert set(rule) >= {"alert", "expr", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["expr"].count("(") == rule["expr"].count(")")
            unknown = referenced_metrics(rule["expr"]) - known
            assert not unknown, f"{rule['alert']}: unknown metrics {unknown}"
            names.add(rule["alert"])
    assert {"MaintdNoLeader", "MaintdServiceFailing", "MaintdServiceStalled", "MaintdRescuedJobsRising",
            "MaintdBacklogAgeGrowing"} <= names


def test_grafana_dashboard_uses_known_metrics():
    known = metric_names()
    dash = json.loads((DEPLOY / "grafana" / "maintd.json").read_text())
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= referenced_metrics(target["expr"])
    assert not used - known, used - known
    spec_metrics = {"maintd_is_leader", "maintd_leadership_changes_total", "maintd_service_runs_total",
                    "maintd_service_run_seconds_bucket", "maintd_service_last_success_timestamp_seconds",
                    "maintd_jobs_deleted_total", "maintd_jobs_rescued_total", "maintd_jobs_promoted_total",
                    "maintd_periodic_enqueued_total", "maintd_periodic_skipped_total", "maintd_reindex_total",
                    "maintd_jobs", "maintd_oldest_available_job_age_seconds"}
    assert spec_metrics <= used


def test_dockerfile_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["maintd"]' in text
