"""The headroom benchmark's bookkeeping: which calls fall in a burst, what served them, the
largest burst served, its report and its arguments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, headroom, paired
from omnitrace import events as ev
from omnitrace.events import MissReason
from omnitrace.signature import InputSpec, Signature

MiB = 1 << 20


def _sig(slices: int) -> Signature:
    return Signature((InputSpec("bfloat16", (slices, 3, 14, 14336), "cuda:0"), None), 0)


def _events() -> list[Any]:
    """A warm-up call before the burst, then in it (t 10..20): an eager first call of 40 slices,
    a capture of 40 and its replay, a call of 10 replayed, an audio call; one call after."""
    return [
        ev.GraphMissed("vision", _sig(60), 5, 5, MissReason.WARMUP, "call 1", 0.1),
        ev.GraphMissed("vision", _sig(40), 11, 11, MissReason.WARMUP, "call 1", 0.1),
        ev.GraphCaptured(
            "vision", _sig(40), 12, 12, 0.2, 1, "cuda:0", 7, 8, 300 * MiB, 2 * MiB, 0, 900 * MiB
        ),
        ev.GraphReplayed("vision", _sig(40), 13, 13, 0.01),
        ev.GraphReplayed("vision", _sig(10), 14, 14, 0.01),
        ev.GraphMissed("audio", _sig(99), 15, 15, MissReason.CAPACITY, "budget", 0.1),
        ev.MemoryDeferred("vision", _sig(50), 16, 16, 700 * MiB, 1024 * MiB, "cuda:0"),
        ev.GraphMissed("vision", _sig(50), 16, 16, MissReason.MEMORY, "floor", 0.1),
        ev.GraphReplayed("vision", _sig(80), 21, 21, 0.01),
    ]


def test_a_burst_counts_only_its_own_vision_calls() -> None:
    calls = headroom.burst_calls(_events(), 10, 20)
    assert calls["calls"] == 4
    assert calls["outcomes"] == {"eager warmup": 1, "graph": 2, "eager memory": 1}
    assert calls["largest"] == 50
    assert calls["captured"] == 1
    assert calls["captured_bytes"] == 302 * MiB
    # The last free memory read in the burst: the deferral's, after the capture's.
    assert calls["free_bytes"] == 700 * MiB
    empty = headroom.burst_calls(_events(), 100, 200)
    assert empty == {
        "calls": 0,
        "outcomes": {},
        "largest": 0,
        "captured": 0,
        "captured_bytes": 0,
        "free_bytes": None,
    }


def _row(n: int, repeat: int, ok: bool, error: str = "") -> dict[str, Any]:
    row = {"requests": n, "repeat": repeat, "ok": ok, "wall_s": 1.5, "vision": {}}
    return row | ({"error": error} if error else {})


def test_the_largest_burst_served_needs_every_repeat() -> None:
    bursts = [_row(1, 0, True), _row(1, 1, True), _row(4, 0, True), _row(4, 1, False, "x")]
    assert headroom.largest_served({"bursts": bursts}) == 1
    assert headroom.largest_served({"bursts": bursts[:3]}) == 4
    assert headroom.largest_served({"bursts": [_row(1, 0, False, "x")]}) == 0


def test_the_report_names_the_stop_and_keeps_text_out_of_the_table_markup() -> None:
    stopped = _row(8, 0, False, "EngineDeadError: died | badly")
    stopped["vision"] = headroom.burst_calls(_events(), 10, 20)
    result = {
        "model": "minicpmo",
        "image": [1344, 1344],
        "device": "NVIDIA H100 80GB HBM3",
        "configs": {
            "eager": {"bursts": [_row(8, 0, True)], "pool_bytes": 0, "oom": None},
            "omnitrace": {
                "bursts": [_row(4, 0, True), stopped],
                "pool_bytes": 3 << 30,
                "oom": "torch.OutOfMemoryError: CUDA out of memory. Tried | to allocate",
            },
        },
    }
    text = headroom.table(result)
    row = next(line for line in text.splitlines() if "| 8 |" in line and "omnitrace" in line)
    assert row.count("|") == 8  # seven cells: the error's bar did not add one
    assert "EngineDeadError: died / badly" in row
    assert "eager memory 1, eager warmup 1, graph 2 (1 captured)" in row
    assert "- eager: the largest burst served 8, the graphs' memory 0.00 GiB" in text
    assert "- omnitrace: the largest burst served 4, the graphs' memory 3.00 GiB; torch" in text
    assert "Tried / to allocate" in text


def test_an_engine_log_gives_its_first_out_of_memory_line(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    assert headroom._oom_line(log) is None
    log.write_text("INFO start\nERROR torch.OutOfMemoryError: CUDA out of memory. Tried\nnext\n")
    assert headroom._oom_line(log) == "ERROR torch.OutOfMemoryError: CUDA out of memory. Tried"
    log.write_text("INFO fine\n")
    assert headroom._oom_line(log) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bursts", "0,2"], "integers of 1 or more"),
        (["--bursts", "two"], "integers separated by commas"),
        (["--image", "1344"], "WIDTHxHEIGHT"),
        (["--image", "10x10"], "WIDTHxHEIGHT"),
        (["--configs", "eager,fast"], "--configs: expected names from eager, omnitrace"),
        (["--repeats", "0"], "--repeats must be 1 or more"),
        (["--warmup", "1"], "--warmup 2 or more"),
        (["--overrides", "[1]"], "--overrides: expected a JSON object, got '[1]'"),
        (["--overrides", "null"], "--overrides: expected a JSON object, got 'null'"),
        (["--overrides", '{"max_graphs": 4}'], "encoder_cuda_graph_* keys only, got 'max_graphs'"),
        (["--images", "0"], "--images from 1 to 64"),
        (["--images", "65"], "--images from 1 to 64"),
        (["--images", "two"], "--images: invalid int value: 'two'"),
    ],
)
def test_bad_arguments_get_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        headroom.main(["--out", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_child_that_fails_without_a_result_fails_the_run_and_keeps_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that dies before writing its result is a failure (exit 1, its log's tail),
    not a stop at a burst; the engine before it keeps its result, in the file and the report."""

    class Child:
        pid = 0

        def __init__(self, argv: list[str], stdout: Any, **_: Any) -> None:
            self.config = argv[argv.index("--engine") + 1]
            if self.config == "eager":
                raw = {"config": "eager", "init_s": 1.0, "scheduler": {}, "bursts": [_sent(2)]}
                raw["bursts"][0].update(ok=True, wall_s=1.0, end_ns=2)
                (tmp_path / "eager" / "raw.json").write_text(json.dumps(raw))
            else:
                stdout.write(b"Traceback: the engine could not start\n")
                stdout.write(
                    b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 MiB\n"
                )
                stdout.write(b"the rest of its output\n")

        def wait(self, timeout: float | None = None) -> int:
            return 0 if self.config == "eager" else 3

        def poll(self) -> int:
            return self.wait()

    monkeypatch.setattr(headroom.subprocess, "Popen", Child)
    monkeypatch.setattr(common, "cuda_probe", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    assert headroom.main(["--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "omnitrace: the engine failed (3) before a burst" in captured.err
    assert "the engine could not start" in captured.err
    result = json.loads((tmp_path / "headroom-minicpmo.json").read_text())
    assert list(result["configs"]) == ["eager"]
    assert result["failed"]["config"] == "omnitrace"
    assert "- eager: the largest burst served 2" in captured.out
    assert (
        "- omnitrace: no result, omnitrace: the engine failed (3) before a burst: "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 MiB\n"
    ) in captured.out
    assert "no result" in (tmp_path / "headroom-minicpmo.md").read_text()


def _sent(n: int) -> dict[str, Any]:
    """A burst as the engine saves it when sending it: no outcome yet."""
    return {"requests": n, "repeat": 0, "start_ns": 1}


def test_a_burst_the_engine_never_answers_is_on_record_as_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine saves each burst as it sends it: one killed at --timeout while a burst was
    out has that burst recorded as not served (a stop, exit 2), the bursts before it kept."""

    class Child:
        pid = 4321

        def __init__(self, argv: list[str], stdout: Any, **kwargs: Any) -> None:
            served = _sent(1) | {"ok": True, "wall_s": 0.5, "end_ns": 1}
            raw = {"config": "omnitrace", "init_s": 1.0, "scheduler": {}}
            raw["bursts"] = [served, _sent(2) | {"start_ns": 2}]
            (tmp_path / "omnitrace" / "raw.json").write_text(json.dumps(raw))

        def wait(self, timeout: float | None = None) -> int:
            if not killed:
                raise subprocess.TimeoutExpired("engine", timeout or 0)
            return -9

        def poll(self) -> int | None:
            return -9 if killed else None

    killed: list[int] = []
    monkeypatch.setattr(headroom.subprocess, "Popen", Child)
    monkeypatch.setattr(headroom.os, "killpg", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(common, "cuda_probe", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    argv = ["--out", str(tmp_path), "--configs", "omnitrace", "--timeout", "5"]
    assert headroom.main(argv) == headroom.STOPPED
    assert killed == [4321]
    result = json.loads((tmp_path / "headroom-minicpmo.json").read_text())
    first, second = result["configs"]["omnitrace"]["bursts"]
    assert first["ok"] is True
    assert second["ok"] is False
    assert second["error"] == "no answer: the engine ended (killed after 5 s)"
    assert second["wall_s"] is None
    assert headroom.largest_served(result["configs"]["omnitrace"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if "| 2 |" in line)
    assert "| no: no answer: the engine ended (killed after 5 s) | - |" in row


@pytest.mark.parametrize(
    ("stop", "status", "name"),
    [
        (lambda: os.kill(os.getpid(), signal.SIGTERM), 143, "SIGTERM"),
        (lambda: (_ for _ in ()).throw(KeyboardInterrupt), 130, "Ctrl-C"),
    ],
)
def test_a_run_stopped_by_sigterm_or_ctrl_c_stops_its_engine_and_keeps_the_results(
    stop: Any,
    status: int,
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM or Ctrl-C while an engine runs kills the engine's process group (it runs in its
    own session, which neither signal reaches) and saves what the engines before it gave."""
    killed: list[tuple[int, int]] = []

    class Child:
        def __init__(self, argv: list[str], stdout: Any, **kwargs: Any) -> None:
            self.config = argv[argv.index("--engine") + 1]
            self.pid = 100 if self.config == "eager" else 200
            raw = {"config": self.config, "init_s": 1.0, "scheduler": {}, "bursts": []}
            (tmp_path / self.config / "raw.json").write_text(json.dumps(raw))

        def wait(self, timeout: float | None = None) -> int:
            if self.config == "omnitrace" and not killed:
                stop()
            return 0 if self.config == "eager" else -9

        def poll(self) -> int | None:
            return None if self.config == "omnitrace" and not killed else 0

    monkeypatch.setattr(headroom.subprocess, "Popen", Child)
    monkeypatch.setattr(headroom.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(common, "cuda_probe", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    before = signal.getsignal(signal.SIGTERM)
    assert headroom.main(["--out", str(tmp_path)]) == status
    assert killed == [(200, signal.SIGKILL)]
    assert signal.getsignal(signal.SIGTERM) is before
    result = json.loads((tmp_path / "headroom-minicpmo.json").read_text())
    assert list(result["configs"]) == ["eager"]
    assert result["failed"] == {"config": "omnitrace", "error": f"omnitrace: stopped by {name}"}
    assert f"omnitrace: stopped by {name}" in capsys.readouterr().err


def test_an_engine_that_hangs_after_its_result_is_stopped_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A child that wrote its result but did not exit within --timeout is killed with its
    process group; the result stands, and the report says how the engine ended."""
    killed: list[tuple[int, int]] = []

    class Child:
        pid = 4321

        def __init__(self, argv: list[str], stdout: Any, **kwargs: Any) -> None:
            assert kwargs["start_new_session"] is True
            config = argv[argv.index("--engine") + 1]
            raw = {"config": config, "init_s": 1.0, "scheduler": {}, "bursts": []}
            (tmp_path / config / "raw.json").write_text(json.dumps(raw))
            self.waits = 0

        def wait(self, timeout: float | None = None) -> int:
            self.waits += 1
            if self.waits == 1:
                raise subprocess.TimeoutExpired("engine", timeout or 0)
            return -9

        def poll(self) -> int | None:
            return None if self.waits == 1 else -9

    monkeypatch.setattr(headroom.subprocess, "Popen", Child)
    monkeypatch.setattr(headroom.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    # The device's name comes from the child probe: no CUDA context beside the engines.
    monkeypatch.setattr(common, "cuda_probe", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    argv = ["--out", str(tmp_path), "--configs", "omnitrace", "--timeout", "5"]
    assert headroom.main(argv) == 0
    assert killed == [(4321, signal.SIGKILL)]
    result = json.loads((tmp_path / "headroom-minicpmo.json").read_text())
    assert result["configs"]["omnitrace"]["exit"] == "killed after 5 s"
    assert result["device"] == "NVIDIA H100 80GB HBM3"
    assert "engine exit: killed after 5 s" in capsys.readouterr().out


def test_overrides_reach_the_graphed_engine_only_and_name_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--overrides`` goes on top of the graphed configuration's settings, every child gets
    it on its command line, and the result and the report's title record it; the eager engine
    keeps its own."""
    budget = {"encoder_cuda_graph_pool_budget_bytes": 4 << 30}
    assert headroom._hf_overrides("omnitrace", budget) == budget
    assert headroom._hf_overrides("eager", budget) == {"encoder_cuda_graph": False}
    children: list[list[str]] = []

    class Child:
        pid = 4321

        def __init__(self, argv: list[str], stdout: Any, **kwargs: Any) -> None:
            children.append(argv)
            config = argv[argv.index("--engine") + 1]
            burst = _row(2, 0, True) | {"start_ns": 0, "end_ns": 1}
            raw = {"config": config, "init_s": 1.0, "scheduler": {}, "bursts": [burst]}
            (tmp_path / config / "raw.json").write_text(json.dumps(raw))

        def wait(self, timeout: float | None = None) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(headroom.subprocess, "Popen", Child)
    monkeypatch.setattr(common, "cuda_probe", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    saved: list[list[str]] = []
    save = headroom._save
    monkeypatch.setattr(
        headroom,
        "_save",
        lambda out, result: saved.append(list(result["configs"])) or save(out, result),
    )
    argv = ["--out", str(tmp_path), "--overrides", json.dumps(budget)]
    assert headroom.main(argv) == 0
    assert saved == [["eager"], ["eager", "omnitrace"]]  # once after each engine, not again
    assert [json.loads(c[c.index("--overrides") + 1]) for c in children] == [budget, budget]
    result = json.loads((tmp_path / "headroom-minicpmo.json").read_text())
    assert result["overrides"] == budget
    title = f"NVIDIA H100 80GB HBM3), omnitrace's graphs with {json.dumps(budget)}"
    assert title in capsys.readouterr().out


def test_the_engine_saves_each_burst_before_sending_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the child saves while a burst is out names that burst without an outcome, so a
    burst that never returns is on record; a burst that raises ends the bursts, recorded."""
    saved: list[dict[str, Any]] = []

    class Engine:
        def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> None:
            if len(prompts) == 2:
                assert "ok" not in saved[-1]["bursts"][-1]
                assert saved[-1]["bursts"][-1]["requests"] == 2
                raise RuntimeError("EngineDeadError\nsecond line")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=dict))
    monkeypatch.setattr(headroom, "offline_engine", lambda *a, **k: (Engine(), False, 0.5))
    monkeypatch.setattr(headroom, "request", lambda *a: {"prompt": a})
    monkeypatch.setattr(headroom, "media_request", lambda *a: {"prompt": a})
    args = headroom._parser().parse_args(
        ["--out", str(tmp_path), "--engine", "omnitrace", "--bursts", "1,2,4", "--repeats", "1"]
    )
    result = headroom._engine(args, lambda r: saved.append(json.loads(json.dumps(r))))
    assert [(b["requests"], b["ok"]) for b in result["bursts"]] == [(1, True), (2, False)]
    assert result["bursts"][1]["error"] == "RuntimeError: EngineDeadError"
    # Before and after each burst sent: the burst of 4 was never sent.
    assert [[b.get("ok") for b in r["bursts"]] for r in saved] == [
        [None],
        [True],
        [True, None],
        [True, False],
    ]


def test_a_request_of_several_images_carries_each_with_its_own_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--images 3``: each request has three placeholders and three images, no two alike in
    the run, and the engine accepts three images a prompt."""

    class Picture:
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def tobytes(self) -> bytes:
            return str(self.seed).encode()

    sent: list[list[Any]] = []
    limits: list[int] = []

    class Engine:
        def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> None:
            sent.append(prompts)

    def engine(*args: Any, images_per_prompt: int, **kwargs: Any) -> tuple[Any, bool, float]:
        limits.append(images_per_prompt)
        return Engine(), False, 0.5

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=dict))
    monkeypatch.setattr(headroom, "offline_engine", engine)
    monkeypatch.setattr(headroom, "request", lambda *a: {"prompt": "warm-up"})
    # An image's content is its seed's (random_image), here without PIL.
    monkeypatch.setattr(paired, "random_image", lambda seed, w, h: Picture(seed))
    argv = ["--out", str(tmp_path), "--engine", "omnitrace", "--bursts", "2", "--repeats", "1"]
    args = headroom._parser().parse_args([*argv, "--images", "3", "--warmup", "2"])
    result = headroom._engine(args, lambda r: None)
    assert limits == [3]
    assert [b["ok"] for b in result["bursts"]] == [True]
    burst = sent[-1]
    assert len(burst) == 2
    pictures = []
    for prompt in burst:
        assert prompt["prompt"].count("(<image>./</image>)") == 3
        assert len(prompt["multi_modal_data"]["image"]) == 3
        pictures += [p.tobytes() for p in prompt["multi_modal_data"]["image"]]
    warmups = [
        p
        for prompts in sent[:-1]
        for p in prompts
        if isinstance(p, dict) and "multi_modal_data" in p
    ]
    pictures += [p.tobytes() for prompt in warmups for p in prompt["multi_modal_data"]["image"]]
    assert len(pictures) == 12  # 2 warm-up and 2 burst requests
    assert len(set(pictures)) == 12


def test_the_report_names_the_images_a_request() -> None:
    result = {
        "model": "minicpmo",
        "image": [1344, 1344],
        "images": 6,
        "device": "NVIDIA H100 80GB HBM3",
        "configs": {},
    }
    assert "Bursts of 1344x1344 images, 6 a request, minicpmo (NVIDIA H100" in headroom.table(
        result
    )
    result["images"] = 1
    assert "Bursts of 1344x1344 images, minicpmo (" in headroom.table(result)
