"""``omnitrace receive`` and the OTLP receiver under it are bounded: a body past the size
limit or one that inflates past it is answered 413 without being held, a bad length 400, a
slow or silent connection is closed, connections past the limit get 503 without a thread,
names are kept up to a number, and SIGTERM stops it within a second whatever the traffic."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from omnitrace.cli import main
from omnitrace.otlp_receiver import DEFAULT_LIMITS, OTLPReceiver, ReceiverLimits
from omnitrace.receive import Received, Tally, describe_request, receive

ROOT = Path(__file__).resolve().parent.parent
SMALL = ReceiverLimits(
    max_body_bytes=64 << 10,
    max_decompressed_bytes=256 << 10,
    header_timeout_s=0.5,
    idle_timeout_s=0.5,
    max_connections=4,
)


def _traces(spans: int, names: int = 10) -> bytes:
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                scope_spans=[ScopeSpans(spans=[Span(name=f"s{i % names}") for i in range(spans)])]
            )
        ]
    ).SerializeToString()


def _head(length: str | int, *extra: str) -> bytes:
    lines = ["POST /v1/traces HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver(limits=SMALL) as started:
        yield started


def _connect(receiver: OTLPReceiver) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=3.0)
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Everything the receiver sends until it closes (within the socket's timeout)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_a_body_past_the_limit_is_answered_413_without_being_read(
    receiver: OTLPReceiver,
) -> None:
    with _connect(receiver) as sock:
        sock.sendall(_head(400 << 20))  # says 400 MiB, sends none of it
        started = time.monotonic()
        answer = _answer(sock)
    assert _status(answer) == 413, answer
    assert b"past the limit of 65536 bytes" in answer
    assert time.monotonic() - started < 1.0
    assert receiver.refusals == {"413 body past max_body_bytes": 1}


def test_a_body_past_the_limit_sent_whole_still_gets_its_413(receiver: OTLPReceiver) -> None:
    """A client that sends all of its body before reading (as most do) reads the 413, not a
    reset: the rest of the body is read and thrown away, briefly, before the close."""
    for _ in range(5):
        with _connect(receiver) as sock:
            sock.sendall(_head(4 << 20) + b"\0" * (4 << 20))
            assert _status(_answer(sock)) == 413
    assert receiver.refusals == {"413 body past max_body_bytes": 5}


def test_a_length_announced_is_not_held_before_the_body_arrives() -> None:
    """Connections that announce the largest body and send ten bytes of it hold ten bytes
    each, not the body they announce."""
    limits = ReceiverLimits(max_body_bytes=8 << 20, idle_timeout_s=2.0, max_connections=8)
    with OTLPReceiver(limits=limits) as receiver:
        tracemalloc.start()
        try:
            held = [_connect(receiver) for _ in range(6)]
            for sock in held:
                sock.sendall(_head(8 << 20) + b"0123456789")
            time.sleep(0.3)
            current, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            for sock in held:
                sock.close()
    assert current < 4 << 20, current


def test_a_gzip_bomb_is_answered_413_and_a_fair_gzip_body_is_taken(
    receiver: OTLPReceiver,
) -> None:
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB
    assert len(bomb) <= SMALL.max_body_bytes
    with _connect(receiver) as sock:
        sock.sendall(_head(len(bomb), "Content-Encoding: gzip") + bomb)
        answer = _answer(sock)
    assert _status(answer) == 413, answer
    assert b"inflates past the limit of 262144 bytes" in answer
    assert receiver.refusals == {"413 inflated past max_decompressed_bytes": 1}
    # Two gzip members, as a sender that appends them may send: both are read.
    body = _traces(100)
    fair = gzip.compress(body[:50]) + gzip.compress(body[50:])
    with _connect(receiver) as sock:
        sock.sendall(_head(len(fair), "Content-Encoding: gzip") + fair)
        assert _status(_answer(sock)) == 200
    assert len(receiver.spans()) == 100


@pytest.mark.parametrize("length", ["-1", "abc", "1e3", "+5", " ", "0x10", "٣"])
def test_a_bad_content_length_is_answered_400_with_no_traceback(
    receiver: OTLPReceiver, capfd: pytest.CaptureFixture[str], length: str
) -> None:
    with _connect(receiver) as sock:
        sock.sendall(_head(length))
        answer = _answer(sock)
    assert _status(answer) == 400, answer
    assert b"bad Content-Length" in answer
    assert "Traceback" not in capfd.readouterr().err
    assert receiver.refusals == {"400 bad Content-Length": 1}


def test_a_length_of_more_digits_than_any_size_is_answered_413(receiver: OTLPReceiver) -> None:
    with _connect(receiver) as sock:
        sock.sendall(_head("9" * 400))
        answer = _answer(sock)
    assert _status(answer) == 413, answer
    assert answer.endswith(
        b"the body of 999999999999999999\xe2\x80\xa6 (400 digits) bytes is past the limit of "
        b"65536 bytes"
    )


def test_chunked_bodies_are_answered_411(receiver: OTLPReceiver) -> None:
    with _connect(receiver) as sock:
        head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\nhello\r\n0\r\n\r\n")
        assert _status(_answer(sock)) == 411


def test_headers_trickled_past_the_header_timeout_are_cut_off(receiver: OTLPReceiver) -> None:
    """A byte every 0.1 s keeps every read short of the idle timeout, but the headers as a
    whole get 0.5 s."""
    with _connect(receiver) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\n")
        started = time.monotonic()
        closed = None
        while time.monotonic() - started < 3.0:
            try:
                sock.sendall(b"X")
            except OSError:
                closed = time.monotonic() - started
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                if sock.recv(1) == b"":
                    closed = time.monotonic() - started
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = time.monotonic() - started
                break
            finally:
                sock.setblocking(True)
    assert closed is not None
    assert closed < 1.5
    assert receiver.wait_for(lambda r: r.refusals == {"closed: header timeout": 1})


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123"]
)
def test_a_silent_connection_is_closed_after_the_idle_timeout(
    receiver: OTLPReceiver, sent: bytes
) -> None:
    """Silent before a request, or half way through its body."""
    with _connect(receiver) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        assert _answer(sock) == b""
        assert time.monotonic() - started < 1.5
    assert receiver.wait_for(lambda r: r.refusals == {"closed: idle timeout": 1})


def test_connections_past_the_limit_get_503_and_no_thread() -> None:
    limits = ReceiverLimits(header_timeout_s=1.0, idle_timeout_s=1.0, max_connections=4)
    with OTLPReceiver(limits=limits) as receiver:
        _connections_past_the_limit(receiver)


def _connections_past_the_limit(receiver: OTLPReceiver) -> None:
    before = threading.active_count()
    held = [_connect(receiver) for _ in range(SMALL.max_connections)]
    try:
        for sock in held:
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\n")  # half-sent: each holds its slot
        time.sleep(0.1)
        extra = [_connect(receiver) for _ in range(40)]
        answers = [_answer(sock) for sock in extra]
        assert [a.split(b"\r\n", 1)[0] for a in answers] == [
            b"HTTP/1.1 503 Service Unavailable"
        ] * len(extra)
        assert threading.active_count() <= before + SMALL.max_connections
        assert receiver.refusals["503 too many connections"] == len(extra)
        for sock in extra:
            sock.close()
    finally:
        for sock in held:
            sock.close()
    # Once they are gone (the header timeout ends them anyway), a request is served again.
    deadline = time.monotonic() + 3.0
    body = _traces(3)
    while True:
        with _connect(receiver) as sock:
            sock.sendall(_head(len(body)) + body)
            status = _status(_answer(sock))
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200


def test_the_summary_keeps_the_first_names_and_counts_the_rest_together() -> None:
    tally = Tally(max_names=3)
    tally.add(Received("traces", ("svc",), 6, Counter({"a": 1, "b": 2, "c": 1, "d": 2})))
    tally.add(Received("traces", ("svc",), 3, Counter({"a": 1, "e": 2})))
    assert tally.names["traces"] == {"a": 2, "b": 2, "c": 1}
    assert tally.other["traces"] == 4
    assert tally.lines(1.0)[1] == (
        "  spans: a 2, b 2, c 1; 4 more under other names (past the first 3)"
    )
    summary = tally.as_json(1.0)["summary"]
    assert summary["other_names"] == {"traces": 4, "metrics": 0, "logs": 0}
    assert summary["spans"] == 9


def test_the_command_line_defaults_are_the_receivers() -> None:
    from omnitrace.cli.parser import build_parser
    from omnitrace.receive import DEFAULT_MAX_NAMES

    args = build_parser().parse_args(["receive"])
    assert args.max_body == DEFAULT_LIMITS.max_body_bytes == 16 << 20
    assert args.max_decompressed == DEFAULT_LIMITS.max_decompressed_bytes == 64 << 20
    assert args.header_timeout == DEFAULT_LIMITS.header_timeout_s
    assert args.idle_timeout == DEFAULT_LIMITS.idle_timeout_s
    assert args.max_connections == DEFAULT_LIMITS.max_connections
    assert args.max_names == DEFAULT_MAX_NAMES


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--max-body", "0"], "argument --max-body: expected a size of at least 1 byte"),
        (["--max-decompressed", "lots"], "argument --max-decompressed: expected a size"),
        (["--header-timeout", "nan"], "argument --header-timeout: expected a number of sec"),
        (["--idle-timeout", "-1"], "argument --idle-timeout: expected a number of seconds"),
        (["--max-connections", "0"], "argument --max-connections: expected an integer from"),
        (["--max-names", "x"], "argument --max-names: expected an integer from 1 to"),
    ],
)
def test_a_bad_limit_is_one_error_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], why: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["receive", *argv])
    assert stopped.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"omnitrace receive: error: {why}"), errors


def test_the_help_says_what_listening_beyond_loopback_exposes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["receive", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--host 0.0.0.0 (or ::) takes them from anyone who can reach the port" in text
    assert "--max-body SIZE" in text


def _flood(port: int, body: bytes, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
                sock.sendall(_head(len(body)) + body)
                _answer(sock)
        except OSError:
            time.sleep(0.01)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_receive_within_a_second_under_a_flood_of_large_requests(
    how: int,
) -> None:
    """Senders that keep sending requests of 100,000 spans: the receiver still stops
    within 1.5 s of the signal and prints its summary."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "receive", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    stop = threading.Event()
    senders: list[threading.Thread] = []
    try:
        assert proc.stderr is not None
        assert "listening for OTLP" in proc.stderr.readline()
        body = _traces(100_000, names=50)
        senders = [
            threading.Thread(target=_flood, args=(port, body, stop), daemon=True) for _ in range(3)
        ]
        for sender in senders:
            sender.start()
        time.sleep(1.0)
        proc.send_signal(how)
        signalled = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("omnitrace receive still ran 10 s after the signal")
        took = time.monotonic() - signalled
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for sender in senders:
            sender.join(5)
    assert took < 1.5, took
    assert proc.returncode == 0
    summary = [line for line in out.splitlines() if line.startswith("received in ")]
    assert len(summary) == 1
    assert "traces: " in summary[0]


def test_a_request_on_request_turns_away_is_answered_503_and_not_kept() -> None:
    """What a stopping receiver does: the exporter is told to retry, and the request is
    neither kept nor reported."""
    with OTLPReceiver(limits=SMALL, on_request=lambda signal, request: False) as receiver:
        body = _traces(3)
        with _connect(receiver) as sock:
            sock.sendall(_head(len(body)) + body)
            answer = _answer(sock)
        assert _status(answer) == 503, answer
        assert receiver.spans() == []
        assert receiver.refusals == {"503 turned away": 1}


def test_grpc_turns_away_with_unavailable_and_bounds_an_inflated_message() -> None:
    """Over gRPC a turned-away export is UNAVAILABLE (retried), and ``max_body_bytes``
    bounds a message once it is inflated: a small gzip message of 2 MB is refused."""
    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    big = ExportTraceServiceRequest.FromString(_traces(2000, names=2000))
    for span in big.resource_spans[0].scope_spans[0].spans:
        span.name = "x" * 1000
    turned_away = [False]
    limits = ReceiverLimits(max_body_bytes=1 << 20)
    on_request = lambda signal, request: not turned_away[0]  # noqa: E731
    with OTLPReceiver("grpc", limits=limits, on_request=on_request) as receiver:
        with grpc.insecure_channel(
            f"127.0.0.1:{receiver.port}", compression=grpc.Compression.Gzip
        ) as channel:
            export = trace_service_pb2_grpc.TraceServiceStub(channel).Export
            with pytest.raises(grpc.RpcError) as refused:
                export(big, timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            turned_away[0] = True
            small = ExportTraceServiceRequest.FromString(_traces(2))
            with pytest.raises(grpc.RpcError) as unavailable:
                export(small, timeout=5)
            assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
            turned_away[0] = False
            export(small, timeout=5)
        assert len(receiver.spans()) == 2


def test_long_names_are_cut_and_services_past_the_limit_are_counted() -> None:
    """A name is kept to 200 characters, so names cost at most their number times that;
    a service past the first ``max_names`` is counted, not listed and not lost."""
    request = ExportTraceServiceRequest.FromString(_traces(1))
    request.resource_spans[0].scope_spans[0].spans[0].name = "n" * 5000
    received = describe_request("traces", request)
    assert list(received.names) == ["n" * 199 + "…"]
    tally = Tally(max_names=2)
    for service in ("a", "b", "c", "a", "d"):
        tally.add(Received("traces", (service,), 1, Counter({"x": 1})))
    assert tally.services == ["a", "b"]
    assert tally.other_services == 2
    assert tally.lines(1.0)[0].startswith(
        "received in 1.0 s from a, b and others (2 requests named a service past the first 2);"
    )
    assert tally.as_json(1.0)["summary"]["other_services"] == 2


def test_receive_prints_each_refusal_and_counts_them_in_the_summary() -> None:
    """An operator sees the 413 their exporter got, as it happens and in the summary."""
    with _running_receive(ReceiverLimits(max_body_bytes=1024)) as (port, _, result):
        for body in (_traces(1000), _traces(2)):
            with socket.create_connection(("127.0.0.1", port), timeout=3.0) as sock:
                sock.sendall(_head(len(body)) + body)
                _answer(sock)
        time.sleep(0.3)
    tally, printed = result[0]
    lines = printed.splitlines()
    assert "refused 413 body past max_body_bytes (1)" in lines
    assert lines[-1] == "  refused: 413 body past max_body_bytes (1)"
    assert tally.refused == {"413 body past max_body_bytes": 1}
    assert tally.items["traces"] == 2


LIMITED = ["--port", "0", "--max-body", "1KiB", "--json"]


def test_a_receive_run_where_everything_was_refused_says_so_with_exit_1() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "receive", "--duration", "2", *LIMITED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stderr is not None
    port = int(re.findall(r"on http://127\.0\.0\.1:(\d+):", proc.stderr.readline())[0])
    body = _traces(1000)
    with socket.create_connection(("127.0.0.1", port), timeout=3.0) as sock:
        sock.sendall(_head(len(body)) + body)
        assert _status(_answer(sock)) == 413
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.splitlines()[-1] == (
        "omnitrace receive: error: nothing was taken: every request was refused (see above)"
    )
    assert out.splitlines()[0] == '{"refused": {"413 body past max_body_bytes": 1}}'
    assert '"refused": {"413 body past max_body_bytes": 1}' in out.splitlines()[-1]


def test_a_request_in_flight_at_the_stop_is_answered_503_not_taken_and_dropped() -> None:
    """Stopped while a request's body is still arriving: the request that completes in the
    half second of grace is answered 503 (the exporter sends it again) and counted as
    turned away, never answered 200 once the summary is made without it."""
    body = _traces(1000)
    with (
        _running_receive() as (port, stop, result),
        socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock,
    ):
        sock.sendall(_head(len(body)) + body[:-10])
        time.sleep(0.1)
        stop.set()
        time.sleep(0.3)  # the summary is being made
        sock.sendall(body[-10:])
        answer = _answer(sock)
    assert _status(answer) == 503, answer
    tally, _ = result[0]
    assert tally.refused == {"503 turned away": 1}
    assert tally.empty


@contextlib.contextmanager
def _running_receive(
    limits: ReceiverLimits = DEFAULT_LIMITS,
) -> Iterator[tuple[int, threading.Event, list[tuple[Tally, str]]]]:
    """Run ``receive`` on a thread; yield its port, its stop event and where its tally and
    what it printed land once it returned (the block's end stops it and waits for it)."""
    endpoint: list[str] = []
    stop = threading.Event()
    result: list[tuple[Tally, str]] = []
    out = io.StringIO()

    def run() -> None:
        tally = receive(
            protocol="http/protobuf",
            host="127.0.0.1",
            port=0,
            as_json=False,
            duration_s=None,
            stop=stop,
            out=out,
            say=lambda line: endpoint.extend(re.findall(r"on http://127\.0\.0\.1:(\d+):", line)),
            limits=limits,
        )
        result.append((tally, out.getvalue()))

    runner = threading.Thread(target=run)
    runner.start()
    try:
        deadline = time.monotonic() + 5.0
        while not endpoint and time.monotonic() < deadline:
            time.sleep(0.01)
        yield int(endpoint[0]), stop, result
    finally:
        stop.set()
        runner.join(5.0)
