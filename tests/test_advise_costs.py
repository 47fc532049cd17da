"""What ``omnitrace advise`` takes a key's eager call to cost, on which its savings rest.

A worker's first eager call of an encoder pays one-off costs (kernels loaded on first
launch, allocator growth), and a key's first call some too: on an H200 they took 0.19-1.97 s
and 20-220 ms, where the same keys' later eager calls took a median 0.40-0.55 of their first.
Calls that ran eagerly while graphs were paused (ineligible, no stream) measure the same
forward. The savings must rest on the later calls, not on the first ones.
"""

from __future__ import annotations

import collections
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from omnitrace import events as ev
from omnitrace.advise import Recording, Setting, replay
from omnitrace.cli import main
from omnitrace.eventlog import EventRecord
from omnitrace.events import MissReason
from omnitrace.signature import InputSpec, Signature

H200_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200"
WORKER = (0, 4242)
MiB = 1 << 20


def _key(size: int, stream: int | None = 7) -> Signature:
    return Signature((InputSpec("bfloat16", (size, 64), "cuda:0"),), stream)


class _Log:
    """One worker's records, as a GPU worker with device timing writes them."""

    def __init__(self) -> None:
        self.records: list[EventRecord] = []
        self.n = 0

    def _add(self, event: ev.Event) -> None:
        self.records.append(EventRecord(event, WORKER[1], WORKER[0]))
        self.n += 1

    def warmup(self, size: int, device_s: float) -> None:
        """The key's first call: a warm-up miss, run eagerly."""
        key = _key(size)
        self._add(ev.GraphMissed("vision", key, self.n, self.n, MissReason.WARMUP, "call 1", 0.1))
        self._add(ev.DeviceTimed("vision", key, self.n, self.n, "eager", device_s))

    def paused(self, size: int, device_s: float) -> None:
        """A call run eagerly while graphs were switched off: ineligible, no stream."""
        key = _key(size, stream=None)
        self._add(
            ev.GraphMissed("vision", key, self.n, self.n, MissReason.INELIGIBLE, "paused", 0.1)
        )
        self._add(ev.DeviceTimed("vision", key, self.n, self.n, "eager", device_s))

    def capture_and_replay(self, size: int, replays: int, device_s: float) -> None:
        key = _key(size)
        captured = ev.GraphCaptured(
            "vision", key, self.n, self.n, 0.2, 1, "cuda:0", 7, 8, 64 * MiB, MiB, 0, None
        )
        self._add(captured)
        for _ in range(replays):
            self._add(ev.GraphReplayed("vision", key, self.n, self.n, 0.01))
            self._add(ev.DeviceTimed("vision", key, self.n, self.n, "replay", device_s))

    def costs(self) -> dict[int, Any]:
        recording = Recording.from_records(self.records)
        return {key.inputs[0].shape[0]: cost for key, cost in recording.costs["vision"].items()}


def test_calls_run_while_graphs_were_paused_are_the_keys_eager_cost() -> None:
    """The encoder's first call (1.5 s) costs nothing in the estimate: the key's eager time is
    the mean of its paused calls, and a hit saves that less the replay."""
    log = _Log()
    log.warmup(100, 1.5)
    log.capture_and_replay(100, 10, 0.002)
    for device_s in (0.020, 0.024, 0.022):
        log.paused(100, device_s)
    cost = log.costs()[100]
    assert cost.eager_s == pytest.approx(0.022)
    assert not cost.estimated_time
    assert not cost.first_calls_only
    result = replay(Recording.from_records(log.records), Setting(4, 2, 0))
    # The capturing call saved nothing; the other nine saved 20 ms each.
    assert result.saved_s == pytest.approx(9 * 0.020)


def test_a_keys_first_call_is_scaled_by_what_the_encoders_other_keys_say() -> None:
    """Key 200's first call took 40 ms and its paused calls 20: half. Key 300 ran eagerly
    only once, in 90 ms: its cost is estimated at half that. The encoder's first call (key
    100, 2 s) is left out of both."""
    log = _Log()
    log.warmup(100, 2.0)
    log.capture_and_replay(100, 4, 0.002)
    log.paused(100, 0.030)
    log.warmup(200, 0.040)
    log.capture_and_replay(200, 4, 0.003)
    log.paused(200, 0.020)
    log.warmup(300, 0.090)
    log.capture_and_replay(300, 4, 0.004)
    costs = log.costs()
    assert costs[100].eager_s == pytest.approx(0.030)
    assert costs[200].eager_s == pytest.approx(0.020)
    assert costs[300].eager_s == pytest.approx(0.045)
    assert costs[300].estimated_time
    assert not costs[300].first_calls_only


def test_a_key_whose_only_eager_call_was_the_encoders_first_is_estimated_from_its_replay() -> None:
    """Key 100's only eager call was the encoder's first (3 s): its cost comes from its replay
    and the encoder's replay-to-eager ratio (key 200: 5 ms replayed, 20 ms eager)."""
    log = _Log()
    log.warmup(100, 3.0)
    log.capture_and_replay(100, 4, 0.008)
    log.warmup(200, 0.020)
    log.capture_and_replay(200, 4, 0.005)
    costs = log.costs()
    assert costs[100].eager_s == pytest.approx(0.032)
    assert costs[100].estimated_time
    # Key 200's time is its first call's, uncorrected: nothing tells its one-off part.
    assert costs[200].eager_s == pytest.approx(0.020)
    assert costs[200].first_calls_only


def test_first_calls_alone_are_used_and_said_to_be_upper_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An encoder that only ever ran its first call eagerly: that is its cost, and advise says
    the savings are upper bounds."""
    from omnitrace.eventlog import encode_event

    log = _Log()
    log.warmup(100, 0.050)
    log.capture_and_replay(100, 4, 0.002)
    assert log.costs()[100].eager_s == pytest.approx(0.050)
    assert log.costs()[100].first_calls_only
    path = tmp_path / "events-0-4242.jsonl"
    path.write_text(
        "".join(
            json.dumps(encode_event(r.item, pid=r.pid, rank=r.rank)) + "\n" for r in log.records
        )
    )
    assert main(["advise", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 keys' eager times from their first calls only" in out
    assert "upper bounds" in out


def _paired_reference(log: Path) -> float:
    """Device time the log's replays saved, against the mean of the same key's calls run
    eagerly while graphs were paused (the benchmark's pairs): keys without any are left out."""
    paused: dict[str, list[float]] = collections.defaultdict(list)
    replays: list[tuple[str, float]] = []
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event.get("type") != "DeviceTimed":
            continue
        key = event["adapter"] + json.dumps(event["signature"]["inputs"])
        if event["kind"] == "replay":
            replays.append((key, event["device_s"]))
        elif event["signature"]["stream"] is None:
            paused[key].append(event["device_s"])
    return sum(sum(paused[k]) / len(paused[k]) - t for k, t in replays if paused[k])


@pytest.mark.parametrize("model", ["minicpmo", "qwen2_5_omni"])
def test_on_the_h200_logs_the_savings_agree_with_the_paired_eager_calls(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The H200 engine benchmark's worker logs (``vllm serve``, omnitrace's defaults, paired
    requests run with graphs paused): advise's saving for the logged setting is within 10 %
    of what the replays saved against the paired eager calls of the same keys. Taking each
    key's first call as its cost said 161 s for Qwen2.5-Omni's 135-s log, 16x too much."""
    with tarfile.open(H200_RESULTS / "engine_defaults_events.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    (log,) = (tmp_path / model / "omnitrace").glob("events-0-*.jsonl")
    reference = _paired_reference(log)
    assert reference > 1.0
    assert main(["advise", str(log), "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)["logged"]["saved_s"]
    assert saved == pytest.approx(reference, rel=0.10)
