"""The deployment files agree with the code: probes hit real endpoints, selectors select, settings exist,
and every metric the dashboard and alerts query is one the service exports. (Schema validation,
hadolint and promtool run in `make lint`.)"""

import json
import re
from pathlib import Path

import pytest
import yaml

from service.app import create_app
from service.metrics import Metrics
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = ROOT / "docker"


def manifest(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.fixture(scope="module")
def pod() -> dict:
    return manifest("deployment.yaml")["spec"]["template"]


def test_every_selector_selects_the_pods(pod):
    labels = pod["metadata"]["labels"]
    deployment = manifest("deployment.yaml")
    service = manifest("service.yaml")
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
        manifest("pdb.yaml")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    monitor = manifest("servicemonitor.yaml")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert manifest("hpa.yaml")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


def test_probes_hit_the_services_own_endpoints(pod):
    container = pod["spec"]["containers"][0]
    routes = set(create_app(Settings()).app.openapi()["paths"])  # the app inside the Guard layer
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert {"/readyz", "/healthz", "/metrics"} <= routes
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = manifest("configmap.yaml")["data"]
    assert ports["http"] == int(config["COREPLY_PORT"])


def test_configmap_names_only_real_settings_and_grace_covers_prestop_plus_drain(pod):
    config = manifest("configmap.yaml")["data"]
    known = {f"COREPLY_{name.upper()}" for name in Settings.model_fields}
    assert set(config) <= known, set(config) - known
    settings = Settings(**{k.removeprefix("COREPLY_").lower(): v for k, v in config.items()})
    pre_stop = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pre_stop[1]) + settings.drain_seconds


def test_pod_runs_non_root_with_a_read_only_root_and_the_bundle_read_only(pod):
    spec = pod["spec"]
    container = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    bundle_dir = manifest("configmap.yaml")["data"]["COREPLY_BUNDLE"]
    mounts = [m for m in container["volumeMounts"] if bundle_dir.startswith(m["mountPath"])]
    assert mounts and all(m["readOnly"] for m in mounts)


SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_metrics() -> set[str]:
    """Every series name the service's registry can expose (labelled ones appear only once used)."""
    return {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in SERIES.get(family.type, ("",))
    }


def queried_metrics(text: str) -> set[str]:
    return set(re.findall(r"\bcoreply_\w+", text))


def test_dashboard_and_alerts_query_only_exported_metrics():
    exported = exported_metrics()
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "coreply.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    alerts = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text())
    exprs += " ".join(r["expr"] for g in alerts["groups"] for r in g["rules"])
    queried = queried_metrics(exprs)
    assert queried and queried <= exported, queried - exported


def test_the_cluster_alerts_are_the_compose_alerts():
    rule = manifest("prometheusrule.yaml")
    alerts = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == alerts["groups"]


def test_compose_scrapes_the_coreply_service_on_its_port():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for s in job["static_configs"] for t in s["targets"]]
    assert targets == ["coreply:8000"]
    coreply = compose["services"]["coreply"]
    assert "${COREPLY_HOST_PORT:-8000}:8000" in coreply["ports"]
    assert all(v.endswith(":ro") for v in coreply["volumes"]) and coreply["read_only"] is True


def test_the_readme_configuration_table_lists_every_setting():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration") :].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(COREPLY_\w+)`", table, re.M))
    assert documented == {f"COREPLY_{name.upper()}" for name in Settings.model_fields}
