"""Helpers shared by the ops tests: load the generator, read queries, walk PromQL and LogQL."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from omnitrace.sinks.names import ATTR, METRICS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PATH = ROOT / "docker-compose.otel.yml"
DASHBOARDS_DIR = ROOT / "dashboards"
DEPLOY_DIR = ROOT / "deploy" / "otel"

#: Grafana variables replaced by a representative value before a query meets a parser.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$encoder": ".*"}
#: Labels that are not OTel attributes: histogram buckets and the scrape's target labels.
PROMETHEUS_BUILTIN_LABELS = frozenset({"le", "job", "instance"})


def load_generator() -> ModuleType:
    """Import ``dashboards/generate.py`` (a script, not part of the package)."""
    path = DASHBOARDS_DIR / "generate.py"
    spec = importlib.util.spec_from_file_location("omnitrace_dashboards_generate", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promql_parser() -> Any:
    """Return the ``promql_parser`` module, skipping when it is not installed."""
    return pytest.importorskip("promql_parser", reason="pip install promql-parser")


def promtool() -> str:
    """Return the path of ``promtool``, skipping when it is not installed."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (.ci/tiers/ops.sh installs it)")
    return path


def series_keys() -> dict[str, str]:
    """Return every series name the Prometheus exporters expose -> its ``names.METRICS`` key."""
    series: dict[str, str] = {}
    for key, metric in METRICS.items():
        if metric.kind == "histogram":
            series.update((metric.prometheus + s, key) for s in ("_bucket", "_sum", "_count"))
        else:
            series[metric.prometheus] = key
    return series


def known_series() -> set[str]:
    """Return every series name the Prometheus exporters expose, from ``names.METRICS``."""
    return set(series_keys())


def prom_label(attribute: str) -> str:
    """Return the Prometheus label name of an OTel attribute key."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", attribute)


def known_labels() -> set[str]:
    """Return every label a query may use: metric attributes plus Prometheus's own."""
    labels = {prom_label(a) for m in METRICS.values() for a in m.attributes}
    assert prom_label(ATTR.ENCODER) in labels
    return labels | PROMETHEUS_BUILTIN_LABELS


@dataclass(frozen=True)
class Query:
    """One query found in a generated file, with where it came from."""

    where: str
    language: str
    """promql or logql."""
    expr: str


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[Query]:
    """Yield every panel target and query variable of a Grafana dashboard JSON model."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            kind = target["datasource"]["type"]
            language = {"prometheus": "promql", "loki": "logql"}[kind]
            yield Query(f"panel {panel['title']!r} {target['refId']}", language, target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, f"unsupported variable query {variable['query']['query']!r}"
            yield Query(f"variable {variable['name']!r}", "promql", match[1])


def rule_queries(path: Path, language: str) -> Iterator[Query]:
    """Yield every rule expression of a Prometheus-format rule file."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    for group in document["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            yield Query(f"{path.name} {name}", language, rule["expr"])


def committed_queries() -> list[Query]:
    """Return the queries of the committed dashboards and rule files."""
    gen = load_generator()
    queries: list[Query] = []
    for path in sorted(DASHBOARDS_DIR.glob("*.json")):
        queries.extend(dashboard_queries(json.loads(path.read_text(encoding="utf-8"))))
    queries.extend(rule_queries(gen.PROMETHEUS_RULES_PATH, "promql"))
    queries.extend(rule_queries(gen.LOKI_RULES_PATH, "logql"))
    return queries


def substitute_variables(expr: str) -> str:
    """Replace Grafana's dashboard variables by values a PromQL parser accepts."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$labels", ""), f"unknown variable in {expr!r}"
    return expr


@dataclass(frozen=True)
class PromQLFacts:
    """What a parsed PromQL expression selects."""

    metrics: frozenset[str]
    labels: frozenset[str]
    matchers: frozenset[tuple[str, str, str]]
    """(label, operator, value) of every label matcher."""


def promql_facts(expr: str) -> PromQLFacts:
    """Parse ``expr`` with the Prometheus parser and collect metrics, labels and matchers."""
    pp = promql_parser()
    tree = pp.parse(substitute_variables(expr))
    metrics: set[str] = set()
    labels: set[str] = set()
    matchers: set[tuple[str, str, str]] = set()

    def visit(node: Any) -> None:
        if isinstance(node, pp.VectorSelector):
            # A selector without a metric name ({__name__=~...}) could match anything.
            assert node.name, f"selector without a metric name in {expr!r}"
            metrics.add(node.name)
            for m in node.matchers.matchers:
                labels.add(m.name)
                matchers.add((m.name, str(m.op), m.value))
            assert not node.matchers.or_matchers, f"'or' matchers in {expr!r}"
        elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, pp.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                labels.update(matching.labels)

    pp.walk(tree, visit)
    return PromQLFacts(frozenset(metrics), frozenset(labels), frozenset(matchers))


#: ``{...}`` stream selector, optional pipeline, optional ``[range]``: the log part of LogQL.
_LOG_RANGE = re.compile(r"\{(?P<selector>[^{}]*)\}(?P<pipeline>[^\[\]()]*)(?:\[(?P<range>\w+)\])?")
_MATCHER = re.compile(r'\s*(?P<name>[a-zA-Z_]\w*)\s*(?P<op>=~|!~|!=|=)\s*"(?P<value>[^"]*)"\s*')
_STAGE_FILTER = re.compile(r'(?P<name>[a-zA-Z_]\w*)\s*(?P<op>=~|!~|!=|==|=)\s*"(?P<value>[^"]*)"')


@dataclass(frozen=True)
class LogQLFacts:
    """What a LogQL query selects: stream labels, parsed fields, grouping labels."""

    stream_matchers: tuple[tuple[str, str, str], ...]
    parsers: tuple[str, ...]
    field_filters: tuple[tuple[str, str, str], ...]
    grouping: frozenset[str]


def logql_facts(expr: str) -> LogQLFacts:
    """Split a LogQL query into its parts; its metric wrapper must parse as PromQL.

    No maintained LogQL parser exists for Python, so the log part (stream selector and
    pipeline) is read with a strict grammar of the forms omnitrace uses, and the metric part
    around it is checked by the Prometheus parser with the log range replaced by a selector.
    """
    logs = list(_LOG_RANGE.finditer(expr))
    assert len(logs) == 1, f"expected one stream selector in {expr!r}"
    log = logs[0]
    stream: list[tuple[str, str, str]] = []
    for part in log["selector"].split(","):
        m = _MATCHER.fullmatch(part)
        assert m, f"bad stream matcher {part!r} in {expr!r}"
        stream.append((m["name"], m["op"], m["value"]))
    parsers: list[str] = []
    filters: list[tuple[str, str, str]] = []
    stages = [s.strip() for s in log["pipeline"].split("|")]
    assert stages[0] == "", f"text before the first pipeline stage in {expr!r}"
    for stage in stages[1:]:
        if stage in ("json", "logfmt"):
            parsers.append(stage)
        elif f := _STAGE_FILTER.fullmatch(stage):
            assert parsers, f"field filter {stage!r} before a parser in {expr!r}"
            filters.append((f["name"], f["op"], f["value"]))
        else:
            raise AssertionError(f"unsupported pipeline stage {stage!r} in {expr!r}")
    grouping: set[str] = set()
    if log.start() > 0 or log.end() < len(expr):
        assert log["range"], f"log query inside a metric query needs a [range]: {expr!r}"
        wrapper = expr[: log.start()] + f"log_range[{log['range']}]" + expr[log.end() :]
        facts = promql_facts(wrapper)
        assert facts.metrics == {"log_range"}, f"extra selectors in {expr!r}"
        grouping = set(facts.labels)
    return LogQLFacts(tuple(stream), tuple(parsers), tuple(filters), frozenset(grouping))


def alloy_stream_labels(config: str) -> set[str]:
    """Return the labels Alloy's config gives the log streams (static and promoted)."""
    static = set(re.findall(r'"(\w+)"\s*=\s*"[^"]*"', _block(config, "local.file_match")))
    static.discard("__path__")
    promoted = set(re.findall(r"(\w+)\s*=", _block(config, "stage.labels")))
    promoted.discard("values")
    return static | promoted


def _block(config: str, header: str) -> str:
    """Return the text of the first ``header ... { ... }`` block (braces balanced)."""
    start = config.index(header)
    open_at = config.index("{", start)
    depth = 0
    for i in range(open_at, len(config)):
        depth += {"{": 1, "}": -1}.get(config[i], 0)
        if depth == 0:
            return config[open_at : i + 1]
    raise AssertionError(f"unbalanced block {header!r}")
