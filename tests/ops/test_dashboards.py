"""Generated dashboards and alert rules: up to date, parseable, naming only real telemetry."""

from __future__ import annotations

import dataclasses
import json

import pytest

from omnitrace.events import MissReason
from omnitrace.sinks import names

from ._support import (
    DASHBOARDS_DIR,
    DEPLOY_DIR,
    Query,
    alloy_stream_labels,
    committed_queries,
    dashboard_queries,
    known_labels,
    known_series,
    load_generator,
    logql_facts,
    prom_label,
    promql_facts,
    series_keys,
)

ALL_QUERIES = committed_queries()
PROMQL = [q for q in ALL_QUERIES if q.language == "promql"]
LOGQL = [q for q in ALL_QUERIES if q.language == "logql"]


def _unknown_metrics() -> dict[str, set[str]]:
    known = known_series()
    found = {q.where: promql_facts(q.expr).metrics - known for q in PROMQL}
    return {where: unknown for where, unknown in found.items() if unknown}


def test_generated_files_are_up_to_date() -> None:
    """The committed dashboard and rule files equal a fresh render from names.py."""
    assert load_generator().stale_files() == []


def test_renaming_a_metric_makes_the_committed_files_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A metric renamed in names.py but not regenerated is caught by the freshness check."""
    hits = names.METRICS["hits"]
    monkeypatch.setitem(
        names.METRICS, "hits", dataclasses.replace(hits, prometheus="omnitrace_renamed_total")
    )
    gen = load_generator()
    stale = gen.stale_files()
    assert gen.DASHBOARD_PATH in stale
    assert gen.PROMETHEUS_RULES_PATH in stale


def test_committed_queries_were_found() -> None:
    """The query scan sees every panel target and every rule, so the checks below bite."""
    dashboard = json.loads((DASHBOARDS_DIR / "omnitrace-encoder-graphs.json").read_text())
    targets = sum(len(p["targets"]) for p in dashboard["panels"])
    assert len(list(dashboard_queries(dashboard))) == targets + 1  # + the encoder variable
    assert len(PROMQL) >= targets + 3
    assert len(LOGQL) == 2


@pytest.mark.parametrize("query", PROMQL, ids=lambda q: q.where)
def test_promql_parses_and_names_only_exported_metrics(query: Query) -> None:
    """Each PromQL query parses with the Prometheus parser and selects only names.py series."""
    facts = promql_facts(query.expr)
    assert facts.metrics, "a query selecting no metric"
    assert facts.metrics <= known_series(), facts.metrics - known_series()


def test_a_metric_renamed_in_names_is_reported_in_the_committed_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Renaming a series in names.py leaves the committed queries naming an unknown metric."""
    assert _unknown_metrics() == {}
    hits = names.METRICS["hits"]
    monkeypatch.setitem(
        names.METRICS, "hits", dataclasses.replace(hits, prometheus="omnitrace_renamed_total")
    )
    unknown = _unknown_metrics()
    assert unknown
    assert all(u == {hits.prometheus} for u in unknown.values())


def test_every_exported_metric_is_on_the_dashboard() -> None:
    """Each metric of names.py appears in at least one dashboard panel."""
    keys = series_keys()
    shown = {
        keys[series]
        for q in PROMQL
        if q.where.startswith("panel")
        for series in promql_facts(q.expr).metrics
    }
    assert shown == set(names.METRICS)


@pytest.mark.parametrize("query", PROMQL, ids=lambda q: q.where)
def test_promql_uses_only_exported_labels_and_values(query: Query) -> None:
    """Labels are metric attributes of names.py; miss-reason matchers use MissReason values."""
    facts = promql_facts(query.expr)
    assert facts.labels <= known_labels(), facts.labels - known_labels()
    reason = prom_label(names.ATTR.MISS_REASON)
    for label, op, value in facts.matchers:
        if label == reason and op in ("=", "!="):
            assert value in {r.value for r in MissReason}


@pytest.mark.parametrize("query", LOGQL, ids=lambda q: q.where)
def test_logql_names_only_log_events_and_fields(query: Query) -> None:
    """LogQL selects Alloy's stream labels, names.LOG_EVENTS events and logged JSON fields."""
    gen = load_generator()
    facts = logql_facts(query.expr)
    stream_labels = alloy_stream_labels((DEPLOY_DIR / "alloy" / "config.alloy").read_text())
    levels = set(names.LOG_EVENTS.values())
    assert facts.parsers == ("json",)
    for label, op, value in facts.stream_matchers:
        assert label in stream_labels
        assert op == "="
        if label == "event":
            assert value in names.LOG_EVENTS
        elif label == "level":
            assert value in levels
        elif label == "service_name":
            assert value == gen.LOG_SERVICE_NAME
    for field, _op, value in facts.field_filters:
        assert field in gen.LOG_FIELDS
        if field == "event":
            assert value in names.LOG_EVENTS
    assert facts.grouping <= set(gen.LOG_FIELDS)


def test_logql_check_rejects_an_unknown_event() -> None:
    """An event missing from names.LOG_EVENTS is refused by the generator's query builder."""
    gen = load_generator()
    with pytest.raises(ValueError, match="log event 'capture_crashed' is not one of"):
        gen.log_query("capture_crashed")


def test_logql_reader_rejects_unsupported_syntax() -> None:
    """The LogQL reader fails on a pipeline stage it does not know instead of skipping it."""
    with pytest.raises(AssertionError, match="unsupported pipeline stage"):
        logql_facts('{service_name="omnitrace"} | json | line_format "{{.message}}"')
