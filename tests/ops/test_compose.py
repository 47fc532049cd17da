"""The compose stack: it parses, mounts files that exist, pins images, binds to loopback."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._support import COMPOSE_PATH, DEPLOY_DIR, ROOT, alloy_stream_labels, load_generator, promtool

#: Host folders the stack writes into or reads at run time; Docker creates them on first start.
RUNTIME_DIRS = {"./logs"}
EXPECTED_SERVICES = {"otel-collector", "jaeger", "prometheus", "loki", "alloy", "grafana"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_PATH.read_text(encoding="utf-8"))


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts.append((volume["source"], volume["target"]))
        else:
            source, target, *_ = volume.split(":")
            mounts.append((source, target))
    return mounts


def _mount_target(compose: dict[str, Any], service: str, source: str) -> str:
    targets = [t for s, t in _mounts(compose["services"][service]) if s == source]
    assert len(targets) == 1, f"{service} does not mount {source} exactly once"
    return targets[0]


def _config(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_compose_file_declares_the_whole_stack(compose: dict[str, Any]) -> None:
    """The compose file parses and runs collector, Jaeger, Prometheus, Loki, Alloy, Grafana."""
    assert set(compose["services"]) == EXPECTED_SERVICES


def test_every_mounted_path_exists(compose: dict[str, Any]) -> None:
    """Every bind mount names a file or folder of the repository (run-time folders aside)."""
    missing = [
        f"{name}: {source}"
        for name, service in compose["services"].items()
        for source, _ in _mounts(service)
        if source not in RUNTIME_DIRS and not (COMPOSE_PATH.parent / source).exists()
    ]
    assert missing == []
    assert all(s.startswith("./") for svc in compose["services"].values() for s, _ in _mounts(svc))


def test_images_are_pinned_to_exact_versions(compose: dict[str, Any]) -> None:
    """Every image carries an exact x.y.z version tag, never latest or a floating major."""
    for name, service in compose["services"].items():
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), name


def test_ports_are_bound_to_loopback(compose: dict[str, Any]) -> None:
    """Every published port is bound to 127.0.0.1, and the UIs are on their usual ports."""
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host, host_port, _container = str(port).split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            published[int(host_port)] = name
    assert published[4317] == published[4318] == "otel-collector"
    assert published[16686] == "jaeger"
    assert published[9090] == "prometheus"
    assert published[3000] == "grafana"


def _components(config: dict[str, Any], kind: str) -> set[str]:
    return set(config.get(kind) or {})


@pytest.mark.parametrize("path", ["collector.yaml", "jaeger.yaml"], ids=str)
def test_collector_style_pipelines_use_declared_components(path: str) -> None:
    """Each pipeline of the collector and Jaeger configs names only components declared there."""
    config = _config(DEPLOY_DIR / path)
    service = config["service"]
    assert set(service.get("extensions", [])) <= _components(config, "extensions")
    for pipeline in service["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= _components(config, kind), (path, kind)


def test_collector_sends_traces_to_jaeger_and_metrics_to_prometheus() -> None:
    """Traces go to Jaeger's OTLP port and Prometheus scrapes the collector's exporter port."""
    collector = _config(DEPLOY_DIR / "collector.yaml")
    jaeger = _config(DEPLOY_DIR / "jaeger.yaml")
    pipelines = collector["service"]["pipelines"]
    (trace_exporter,) = pipelines["traces"]["exporters"]
    jaeger_grpc = jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert collector["exporters"][trace_exporter]["endpoint"] == (
        "jaeger:" + jaeger_grpc.rsplit(":", 1)[1]
    )
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    exporter_port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    prometheus = _config(DEPLOY_DIR / "prometheus" / "prometheus.yml")
    targets = [
        t
        for job in prometheus["scrape_configs"]
        for c in job["static_configs"]
        for t in c["targets"]
    ]
    assert targets == [f"otel-collector:{exporter_port}"]


def test_prometheus_loads_the_generated_rules(compose: dict[str, Any]) -> None:
    """Prometheus's rule_files glob covers the mounted folder holding the generated rules."""
    gen = load_generator()
    rules_dir = gen.PROMETHEUS_RULES_PATH.parent.relative_to(ROOT)
    target = _mount_target(compose, "prometheus", f"./{rules_dir.as_posix()}")
    prometheus = _config(DEPLOY_DIR / "prometheus" / "prometheus.yml")
    container_rule = f"{target}/{gen.PROMETHEUS_RULES_PATH.name}"
    assert any(Path(container_rule).match(g) for g in prometheus["rule_files"])


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """promtool accepts prometheus.yml with its rule glob pointed at the repository's rules."""
    gen = load_generator()
    config = _config(DEPLOY_DIR / "prometheus" / "prometheus.yml")
    config["rule_files"] = [str(gen.PROMETHEUS_RULES_PATH.parent / "*.yml")]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = subprocess.run(
        [promtool(), "check", "config", str(local)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_loki_ruler_reads_the_generated_log_rules(compose: dict[str, Any]) -> None:
    """Loki's ruler directory is the mounted folder whose tenant subfolder holds the log rules."""
    gen = load_generator()
    tenant_dir = gen.LOKI_RULES_PATH.parent
    assert tenant_dir.name == "fake"  # the tenant id Loki uses without auth
    loki = _config(DEPLOY_DIR / "loki" / "loki.yaml")
    assert loki["auth_enabled"] is False
    source = f"./{tenant_dir.parent.relative_to(ROOT).as_posix()}"
    assert loki["ruler"]["storage"]["local"]["directory"] == _mount_target(compose, "loki", source)


def test_alloy_tails_the_mounted_log_folder_and_pushes_to_loki(compose: dict[str, Any]) -> None:
    """Alloy reads *.log from the ./logs mount, labels service_name, and writes to Loki."""
    config = (DEPLOY_DIR / "alloy" / "config.alloy").read_text(encoding="utf-8")
    target = _mount_target(compose, "alloy", "./logs")
    assert f'"__path__"     = "{target}/*.log"' in config
    loki_port = _config(DEPLOY_DIR / "loki" / "loki.yaml")["server"]["http_listen_port"]
    assert f'url = "http://loki:{loki_port}/loki/api/v1/push"' in config
    assert alloy_stream_labels(config) == set(load_generator().LOG_STREAM_LABELS)
    assert f"./{(DEPLOY_DIR / 'alloy' / 'config.alloy').relative_to(ROOT).as_posix()}" in {
        s for s, _ in _mounts(compose["services"]["alloy"])
    }


def test_grafana_provisions_the_datasources_the_dashboards_use(compose: dict[str, Any]) -> None:
    """Datasource uids match the dashboards' and the provider path is the dashboards mount."""
    grafana = DEPLOY_DIR / "grafana" / "provisioning"
    datasources = _config(grafana / "datasources" / "datasources.yaml")["datasources"]
    by_type = {d["type"]: d for d in datasources}
    assert set(by_type) == {"prometheus", "loki", "jaeger"}
    gen = load_generator()
    assert by_type["prometheus"]["uid"] == gen.PROMETHEUS_DS["uid"]
    assert by_type["loki"]["uid"] == gen.LOKI_DS["uid"]
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686"
    (provider,) = _config(grafana / "dashboards" / "dashboards.yaml")["providers"]
    assert provider["options"]["path"] == _mount_target(compose, "grafana", "./dashboards")
    assert _mount_target(compose, "grafana", "./deploy/otel/grafana/provisioning") == (
        "/etc/grafana/provisioning"
    )


def test_grafana_admin_password_has_no_default(compose: dict[str, Any]) -> None:
    """Grafana's admin password comes only from GRAFANA_ADMIN_PASSWORD, which compose
    requires (${VAR:?message} stops `up` with the message while it is unset)."""
    environment = compose["services"]["grafana"]["environment"]
    required = re.fullmatch(
        r"\$\{GRAFANA_ADMIN_PASSWORD:\?([^}$]+)\}", environment["GF_SECURITY_ADMIN_PASSWORD"]
    )
    assert required is not None
    assert "GRAFANA_ADMIN_PASSWORD" in required.group(1)
    assert "docs/observability-stack.md" in required.group(1)
    assert not any(k.startswith("GF_SECURITY_ADMIN_PASSWORD__") for k in environment)
    ops = (ROOT / "docs" / "observability-stack.md").read_text(encoding="utf-8")
    assert "export GRAFANA_ADMIN_PASSWORD=" in ops
    assert "`admin`/`admin`" not in ops


def test_prometheus_exposes_no_lifecycle_or_admin_endpoints(compose: dict[str, Any]) -> None:
    """Prometheus runs without --web.enable-lifecycle or --web.enable-admin-api, so nothing
    can reload, stop or wipe it over unauthenticated HTTP."""
    command = compose["services"]["prometheus"]["command"]
    assert not [flag for flag in command if flag.startswith("--web.enable-")]
