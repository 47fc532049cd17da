"""Prometheus alert rules: promtool accepts them and they fire on the situations they name."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from omnitrace.events import MissReason
from omnitrace.sinks.names import ATTR, METRICS

from ._support import load_generator, prom_label, promtool

ENCODER = prom_label(ATTR.ENCODER)
REASON = prom_label(ATTR.MISS_REASON)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, check=False)


def _alerts() -> dict[str, dict[str, Any]]:
    rules = load_generator().prometheus_rules()
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"]}


def test_rule_file_passes_promtool_check() -> None:
    """promtool check rules accepts the committed Prometheus rule file."""
    path = load_generator().PROMETHEUS_RULES_PATH
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


def test_promtool_check_rejects_a_broken_rule(tmp_path: Path) -> None:
    """promtool check rules fails on a rule whose PromQL does not parse, so the check bites."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "sum(("}]}]})
    )
    assert _promtool("check", "rules", str(broken)).returncode != 0


def _series(metric: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{body}}}", "values": values}


def _expected(alert: str, encoder: str, value_text: str = "") -> dict[str, Any]:
    rule = _alerts()[alert]
    annotations = {
        k: v.replace("{{ $labels." + ENCODER + " }}", encoder).replace(
            "{{ $value | humanizePercentage }}", value_text
        )
        for k, v in rule["annotations"].items()
    }
    return {"exp_labels": {**rule["labels"], ENCODER: encoder}, "exp_annotations": annotations}


def test_alerts_fire_on_their_situations_and_stay_quiet_otherwise(tmp_path: Path) -> None:
    """Each alert fires for the encoder in its situation and never for a healthy encoder."""
    gen = load_generator()
    hits, misses = METRICS["hits"].prometheus, METRICS["misses"].prometheus
    failures = METRICS["capture_failures"].prometheus
    capacity = MissReason.CAPACITY.value
    # 1-minute samples for an hour. "vision": 1 hit/s and 2 capacity misses/s (hit rate 1/3,
    # capacity share 2/3) and one failed capture. "audio": 10 hits/s, a few warm-up misses.
    series = [
        _series(hits, {ENCODER: "vision"}, "0+60x60"),
        _series(misses, {ENCODER: "vision", REASON: capacity}, "0+120x60"),
        _series(failures, {ENCODER: "vision"}, "1x60"),
        _series(hits, {ENCODER: "audio"}, "0+600x60"),
        _series(misses, {ENCODER: "audio", REASON: MissReason.WARMUP.value}, "2x60"),
        _series(failures, {ENCODER: "audio"}, "0x60"),
    ]
    late, early = "45m", "5m"
    alert_cases = [
        {
            "eval_time": early,
            "alertname": "OmnitraceCaptureFailed",
            "exp_alerts": [_expected("OmnitraceCaptureFailed", "vision")],
        },
        # Pending, not yet firing, before the 15-minute hold has passed.
        {"eval_time": early, "alertname": "OmnitraceHitRateLow", "exp_alerts": []},
        {"eval_time": early, "alertname": "OmnitraceCapacityMisses", "exp_alerts": []},
        {
            "eval_time": late,
            "alertname": "OmnitraceHitRateLow",
            "exp_alerts": [_expected("OmnitraceHitRateLow", "vision", "33.33%")],
        },
        {
            "eval_time": late,
            "alertname": "OmnitraceCapacityMisses",
            "exp_alerts": [_expected("OmnitraceCapacityMisses", "vision")],
        },
    ]
    assert {c["alertname"] for c in alert_cases} == set(_alerts()) - {
        "OmnitraceRequestPhaseDominates"  # its own test below
    }
    tests = {
        "rule_files": [str(gen.PROMETHEUS_RULES_PATH)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alert_cases}],
    }
    path = tmp_path / "omnitrace.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_dominant_request_phase_alerts_and_the_models_own_prefill_does_not(
    tmp_path: Path,
) -> None:
    """OmnitraceRequestPhaseDominates fires for the processor at 60 % of TTFT after its
    5-minute hold, not before, never for a phase under half, and never for prefill (the
    model's own work), however large its share."""
    phase_label = prom_label(ATTR.REQUEST_PHASE)
    kind_label = prom_label(ATTR.REQUEST_KIND)
    sums = METRICS["request_phase_duration"].prometheus + "_sum"

    def phase(name: str, seconds_per_minute: int, kind: str = "image") -> dict[str, str]:
        return _series(sums, {kind_label: kind, phase_label: name}, f"0+{seconds_per_minute}x60")

    rule = _alerts()["OmnitraceRequestPhaseDominates"]

    def firing(name: str, share: str) -> dict[str, Any]:
        annotations = {
            k: v.replace("{{ $labels." + phase_label + " }}", name).replace(
                "{{ $value | humanizePercentage }}", share
            )
            for k, v in rule["annotations"].items()
        }
        return {
            "exp_labels": {**rule["labels"], phase_label: name},
            "exp_annotations": annotations,
        }

    # A processor-bound server: processor 36 s of every minute's 60 s of TTFT (60 %), then
    # prefill 18 s, render 6 s (10 %). A second server, prefill-bound: prefill 80 %.
    busy = [phase("processor", 36), phase("prefill", 18), phase("render", 6)]
    prefill_bound = [phase("prefill", 48), phase("processor", 6), phase("queue", 6)]
    tests = {
        "rule_files": [str(load_generator().PROMETHEUS_RULES_PATH)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": busy,
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": rule["alert"], "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": rule["alert"],
                        "exp_alerts": [firing("processor", "60%")],
                    },
                ],
            },
            {
                "interval": "1m",
                "input_series": prefill_bound,
                "alert_rule_test": [
                    {"eval_time": "20m", "alertname": rule["alert"], "exp_alerts": []}
                ],
            },
        ],
    }
    path = tmp_path / "phases.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
