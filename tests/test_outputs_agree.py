"""One run, four outputs: the graph_summary lines, top --json, replay --json and the stats."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from omnitrace import derive_stats
from omnitrace.cli import main
from omnitrace.sinks.jsonl import read_events
from omnitrace.stats import STATS_KEYS

#: Fields of a log line that are the line's, not the encoder's.
LINE_FIELDS = {"event", "level", "timestamp", "final"}
#: Fields only top --json has: it lists each worker's encoders apart.
WORKER_FIELDS = {"rank", "pid"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A simulated demo with an event log and a log file, then top and replay on its log."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("OTEL_")}
    tmp = tmp_path_factory.mktemp("agree")
    log, lines, summary = tmp / "run.jsonl", tmp / "log.jsonl", tmp / "summary.json"
    try:
        argv = ["demo", "--no-tui", "--cpu", "--requests", "120", "--events-log", str(log)]
        argv += ["--log-file", str(lines), "--json-summary", str(summary)]
        assert main(argv) == 0
        top = _json_of(["top", "--json", str(log)])
        replay = _json_of(["replay", "--json", str(log)])
    finally:
        os.environ.update(saved)
    final = [
        json.loads(line)
        for line in lines.read_text().splitlines()
        if '"graph_summary"' in line and json.loads(line).get("final")
    ]
    return {
        "summary": {line["encoder"]: line for line in final},
        "top": top,
        "replay": replay,
        "stats": {name: dict(stats) for name, stats in derive_stats(read_events(log)).items()},
        "demo": json.loads(summary.read_text())["encoders"],
    }


def _json_of(argv: list[str]) -> Any:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def test_summary_top_and_replay_say_the_same_of_each_encoder(outputs: dict[str, Any]) -> None:
    """Field by field, the final graph_summary line, top --json's entry and replay --json's
    entry of each encoder are equal, the misses' details included (top adds only the
    worker's rank and pid)."""
    top = {entry["encoder"]: entry for entry in outputs["top"]["encoders"]}
    replay = outputs["replay"]["encoders"]
    summary = outputs["summary"]
    assert set(summary) == set(top) == set(replay) == {"vision", "audio"}
    for name in summary:
        line = {k: v for k, v in summary[name].items() if k not in LINE_FIELDS}
        entry = {k: v for k, v in top[name].items() if k not in WORKER_FIELDS}
        # A field one output has and another lacks belongs in encoder_summary, which makes
        # all three.
        assert line == entry == replay[name], name
        assert set(top[name]) - set(entry) == WORKER_FIELDS
        # The simulated demo's warm-ups and capacity misses, by detail.
        assert sum(line["miss_details"]["warmup"].values()) > 0, line["miss_details"]


def test_lost_s_is_null_everywhere_on_the_simulated_backend(outputs: dict[str, Any]) -> None:
    """A simulated replay runs the forward again: no output gives its lost time a number,
    while the eager time of the misses, measured, is given by all."""
    for name, line in outputs["summary"].items():
        assert line["backend"] == "simulated"
        assert line["lost_s"] is None
        assert line["eager_s"] > 0
        assert outputs["replay"]["encoders"][name]["lost_s"] is None


def test_the_stats_of_the_log_and_of_the_run_are_the_outputs_stats(
    outputs: dict[str, Any],
) -> None:
    """derive_stats of the event log and the demo's own summary give the nine stats keys
    the three outputs give."""
    for name, line in outputs["summary"].items():
        keys = {key: line[key] for key in STATS_KEYS}
        assert {key: outputs["stats"][name][key] for key in STATS_KEYS} == keys
        assert {key: outputs["demo"][name][key] for key in STATS_KEYS} == keys
        assert outputs["demo"][name]["calls"] == line["calls"]


def test_replay_lists_the_encoders_in_the_order_top_does(outputs: dict[str, Any]) -> None:
    """Vision before audio, as the demo registered them and top lists them."""
    assert list(outputs["replay"]["encoders"]) == [
        entry["encoder"] for entry in outputs["top"]["encoders"]
    ]
    assert list(outputs["replay"]["encoders"]) == ["vision", "audio"]


def test_replay_table_lists_vision_before_audio(
    outputs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The replayed stats table's rows come in the demo's and top's order."""
    log = Path(outputs["top"]["logs"][0])
    assert main(["replay", str(log)]) == 0
    out = capsys.readouterr().out
    assert 0 < out.index("│ vision") < out.index("│ audio")
