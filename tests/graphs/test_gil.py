"""Sharing the GIL with a compile: the switch interval, and a compiling thread that pauses
while eager encoder calls are in flight."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from omnitrace.graphs.gil import CompileYield, SwitchInterval


def test_the_switch_interval_is_restored_only_by_the_last_compile_and_never_over_the_hosts() -> (
    None
):
    host = sys.getswitchinterval()
    interval = SwitchInterval(host / 10)
    with interval.short():
        with interval.short():
            assert sys.getswitchinterval() == pytest.approx(host / 10)
        assert sys.getswitchinterval() == pytest.approx(host / 10)  # one compile still runs
    assert sys.getswitchinterval() == host
    try:
        with interval.short():
            sys.setswitchinterval(host * 2)  # the host changes it meanwhile: its choice stays
        assert sys.getswitchinterval() == pytest.approx(host * 2)
    finally:
        sys.setswitchinterval(host)
    longer = SwitchInterval(host * 10)  # never lengthens the host's interval
    with longer.short():
        assert sys.getswitchinterval() == host


def _step() -> None:
    """One Python call: a point where a yielding thread may pause."""


def _serving_step() -> None:
    """A serving thread's Python call (its own code: a location the compile never runs)."""


class _Compiler:
    """A thread that makes Python calls under ``yielding()``, counting them, until stopped."""

    def __init__(self, gate: CompileYield) -> None:
        self.calls = 0
        self.profile_inside: Callable[..., Any] | None = None
        self._stop = threading.Event()
        self._gate = gate
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._gate.yielding():
            self.profile_inside = sys.getprofile()
            while not self._stop.is_set():
                _step()
                self.calls += 1

    def progress(self, seconds: float) -> int:
        """Calls made during ``seconds``."""
        before = self.calls
        time.sleep(seconds)
        return self.calls - before

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


def _assert_an_eager_call_holds_a_compile(gate: CompileYield) -> None:
    """A compiling thread under ``gate`` makes no progress while an eager call is in flight."""
    compiler = _Compiler(gate)
    token = gate.begin()
    try:
        time.sleep(0.05)  # let it reach its next call and pause there
        assert compiler.progress(0.2) == 0
    finally:
        gate.end(token)
        compiler.stop()


HAS_MONITORING = hasattr(sys, "monitoring")

#: Each way a compiling thread looks for eager calls that this interpreter has.
MECHANISMS = ["profile"] + (["monitoring"] if HAS_MONITORING else [])


def _gate(mechanism: str, **times: float) -> CompileYield:
    values = {"max_pause_s": 30.0, "slice_s": 0.001, "step_s": 0.0005, **times}
    gate = CompileYield(**values, use_monitoring=mechanism == "monitoring")
    assert gate.mechanism == mechanism
    return gate


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_yielding_thread_pauses_while_an_eager_call_is_in_flight(mechanism: str) -> None:
    gate = _gate(mechanism)
    compiler = _Compiler(gate)
    try:
        assert compiler.progress(0.1) > 0  # no eager call: it runs
        token = gate.begin()
        time.sleep(0.05)  # let it reach its next call and pause there
        assert gate.in_flight == 1
        assert compiler.progress(0.3) == 0
        gate.end(token)
        assert gate.in_flight == 0
        assert compiler.progress(0.3) > 0  # resumed
    finally:
        compiler.stop()
    stats = gate.statistics()
    assert stats.pauses >= 1
    assert stats.paused_s >= 0.3
    assert stats.cut_short == 0


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_pause_ends_at_its_limit_and_the_compile_then_runs_a_slice(mechanism: str) -> None:
    """Under eager calls that never end, the compile still gets its slices."""
    gate = _gate(mechanism, max_pause_s=0.05, slice_s=0.05, step_s=0.001)
    token = gate.begin()
    compiler = _Compiler(gate)
    try:
        assert compiler.progress(1.0) > 0
    finally:
        compiler.stop()  # first: a pause that the call's end cut off would not count as cut
        gate.end(token)
    stats = gate.statistics()
    assert stats.cut_short >= 2
    assert stats.cut_short == stats.pauses
    # Paused about half the time: no pause runs past its limit by much.
    assert stats.paused_s <= stats.pauses * 0.05 + 0.5


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_only_the_compiling_thread_pauses(mechanism: str) -> None:
    """A serving thread's own Python calls never wait, whatever is in flight."""
    gate = _gate(mechanism)
    compiler = _Compiler(gate)
    token = gate.begin()
    try:
        time.sleep(0.05)
        started = time.monotonic()
        calls = 0
        while time.monotonic() - started < 0.2:
            _serving_step()
            calls += 1
        assert calls > 1000
        assert compiler.progress(0.1) == 0  # while the compiling thread stays paused
    finally:
        gate.end(token)
        compiler.stop()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_compile_that_raises_leaves_nothing_installed(mechanism: str) -> None:
    gate = _gate(mechanism)
    tools = _free_tools()
    with pytest.raises(RuntimeError, match="compile failed"), gate.yielding():
        raise RuntimeError("compile failed")
    assert sys.getprofile() is None
    assert _free_tools() == tools
    _assert_an_eager_call_holds_a_compile(gate)  # the next compile is watched again


@pytest.mark.skipif(not HAS_MONITORING, reason="sys.monitoring needs Python 3.12")
def test_two_compiling_threads_share_one_tool_id_until_the_last_ends() -> None:
    gate = _gate("monitoring")
    tools = _free_tools()
    first, second = _Compiler(gate), _Compiler(gate)
    try:
        time.sleep(0.05)
        assert len(_free_tools()) == len(tools) - 1
        token = gate.begin()
        time.sleep(0.05)
        before = (first.calls, second.calls)
        time.sleep(0.2)
        assert (first.calls, second.calls) == before  # both paused
        gate.end(token)
        first.stop()
        assert len(_free_tools()) == len(tools) - 1  # the second still compiles
    finally:
        second.stop()
        first.stop()
    assert _free_tools() == tools


def _free_tools() -> list[int]:
    """The sys.monitoring tool ids a compile may take that are free now."""
    if not HAS_MONITORING:
        return []
    monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    return [tool for tool in (3, 4) if monitoring.get_tool(tool) is None]


def test_the_profile_function_is_the_threads_own_and_the_previous_one_comes_back() -> None:
    gate = _gate("profile")
    previous_calls: list[str] = []

    def previous(frame: Any, event: str, arg: Any) -> None:
        previous_calls.append(event)

    seen_by_other: list[object] = []
    sys.setprofile(previous)
    try:
        with gate.yielding():
            inside = sys.getprofile()
            # Another thread never pauses: the profile function is this thread's alone.
            other = threading.Thread(target=lambda: seen_by_other.append(sys.getprofile()))
            other.start()
            other.join(5)
        after = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert seen_by_other == [None]
    assert inside is not previous
    assert after is previous


@pytest.mark.skipif(not HAS_MONITORING, reason="sys.monitoring needs Python 3.12")
def test_monitoring_takes_a_free_tool_id_while_compiling_and_gives_it_back() -> None:
    monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    gate = _gate("monitoring")
    free = [tool for tool in (3, 4) if monitoring.get_tool(tool) is None]
    assert free
    with gate.yielding():
        assert monitoring.get_tool(free[0]) == "omnitrace"
        assert sys.getprofile() is None
    assert monitoring.get_tool(free[0]) is None


@pytest.mark.skipif(not HAS_MONITORING, reason="sys.monitoring needs Python 3.12")
def test_without_a_free_tool_id_the_profile_function_stands_in() -> None:
    monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    taken = [tool for tool in (3, 4) if monitoring.get_tool(tool) is None]
    for tool in taken:
        monitoring.use_tool_id(tool, "another tool")
    try:
        gate = _gate("monitoring")
        with gate.yielding():
            assert sys.getprofile() is not None
        assert sys.getprofile() is None
        _assert_an_eager_call_holds_a_compile(gate)  # it still pauses
    finally:
        for tool in taken:
            monitoring.free_tool_id(tool)


def test_eager_calls_on_several_threads_each_hold_the_pause() -> None:
    gate = CompileYield(max_pause_s=30.0, slice_s=0.001, step_s=0.0005)
    first, second = gate.begin(), gate.begin()
    assert gate.in_flight == 2
    gate.end(first)
    assert gate.in_flight == 1
    gate.end(first)  # ending twice changes nothing
    assert gate.in_flight == 1
    gate.end(second)
    assert gate.in_flight == 0


@pytest.mark.parametrize("field", ["max_pause_s", "slice_s", "step_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_times_must_be_positive(field: str, value: float) -> None:
    times = {"max_pause_s": 0.02, "slice_s": 0.002, "step_s": 0.0001, field: value}
    with pytest.raises(ValueError, match=field):
        CompileYield(**times)
