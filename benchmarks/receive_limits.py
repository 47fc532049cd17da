"""``omnitrace receive`` against hostile senders: its limits, and how fast a signal stops it.

Not part of a suite: a probe of the promises in docs/reliability.md, run by hand::

    python -m benchmarks.receive_limits length|body|bomb|half|sigterm|flood [--root DIR]

Each probe starts ``omnitrace receive`` (from ``--root``, default this checkout: point it at
another checkout to measure that one) on a free loopback port and reports:

- ``length``: the answers to ``Content-Length: -1`` and ``abc``, and whether a traceback
  reached the receiver's standard error;
- ``body``: the answer to a 400 MiB body sent whole, and the receiver's peak RSS;
- ``bomb``: the same for a gzip body of 1 MiB that inflates to 1 GiB;
- ``half``: 400 connections that send a request line and one header, then nothing: the
  receiver's threads while they are held, what each got and when;
- ``sigterm``: 10 tries of a SIGTERM sent right after a 13 MiB request (400,000 spans) was
  sent, before its answer: the time to exit, the summary, what the request got;
- ``flood``: 10 tries of a SIGTERM sent while three senders post requests of 100,000 spans
  without a pause.
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

ROOT = Path(__file__).resolve().parent.parent


def _traces(spans: int) -> bytes:
    made = [Span(name=f"s{i % 50}", trace_id=b"t" * 16, span_id=b"s" * 8) for i in range(spans)]
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=made)])]
    ).SerializeToString()


def _head(length: str | int, *extra: str) -> bytes:
    lines = ["POST /v1/traces HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(sock: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except OSError as exc:
        return got or f"({type(exc).__name__})".encode()
    return got


def _send(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError as exc:
            return f"(sending: {type(exc).__name__}) ".encode() + _answer(sock)
        return _answer(sock)


def _first(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, no answer)"


def _last(answer: bytes) -> str:
    return answer.rsplit(b"\r\n", 1)[-1][:100].decode(errors="replace")


class Receiver:
    """``omnitrace receive`` from ``root``, on a free port."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnitrace", "receive", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        assert self.proc.stderr is not None
        self.proc.stderr.readline()  # listening for OTLP ...

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def stop(self, timeout: float = 20.0) -> tuple[float, str, str]:
        """SIGTERM; the seconds it took to exit (inf: killed after ``timeout``)."""
        self.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=timeout)
            took = time.monotonic() - sent
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            took = float("inf")
        return took, out, err


def length(root: Path) -> None:
    receiver = Receiver(root)
    for value in ("-1", "abc"):
        started = time.monotonic()
        answer = _send(receiver.port, _head(value), timeout=6.0)
        took = time.monotonic() - started
        print(f"Content-Length: {value}: {_first(answer)!r} {_last(answer)!r} in {took:.3f} s")
    _, _, err = receiver.stop()
    print(f"traceback on standard error: {'Traceback' in err}")


def _rss(root: Path, label: str, data: bytes) -> None:
    receiver = Receiver(root)
    time.sleep(0.5)
    before = receiver.status("VmRSS")
    started = time.monotonic()
    answer = _send(receiver.port, data)
    took = time.monotonic() - started
    time.sleep(0.3)
    peak = receiver.status("VmHWM")
    print(f"{label}: {_first(answer)!r} {_last(answer)!r} in {took:.2f} s")
    print(f"RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB")
    receiver.stop()


def body(root: Path) -> None:
    _rss(root, "400 MiB body", _head(400 << 20) + b"\0" * (400 << 20))


def bomb(root: Path) -> None:
    # 16 gzip members of 64 MiB of zeros each: 1 MiB sent, 1 GiB inflated.
    data = b"".join(gzip.compress(b"\0" * (64 << 20), 9) for _ in range(16))
    _rss(
        root,
        f"gzip body of {len(data) / 2**20:.2f} MiB (1 GiB inflated)",
        _head(len(data), "Content-Encoding: gzip") + data,
    )


def half(root: Path) -> None:
    receiver = Receiver(root)
    time.sleep(0.5)
    idle = receiver.status("Threads")
    held = []
    for _ in range(400):
        sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=60.0)
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")
        held.append(sock)
    sent = time.monotonic()
    time.sleep(1.0)
    threads = receiver.status("Threads")
    got: dict[str, list[float]] = {}
    lock = threading.Lock()

    def read(sock: socket.socket) -> None:
        what = _first(_answer(sock))
        with lock:
            got.setdefault(what, []).append(time.monotonic() - sent)

    readers = [threading.Thread(target=read, args=(sock,)) for sock in held]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(70.0)
    print(f"400 half-sent requests: receiver threads {idle} idle, {threads} while they are held")
    for what, when in sorted(got.items()):
        print(f"  {len(when)}: {what!r}, the last {max(when):.2f} s after the 400 were sent")
    _, out, _ = receiver.stop()
    print("  summary:", [line for line in out.splitlines() if "refused" in line][-1:])
    for sock in held:
        sock.close()


def sigterm(root: Path) -> None:
    data = _traces(400_000)
    print(f"a request of {len(data) / 2**20:.1f} MiB (400,000 spans), SIGTERM once it is sent")
    takes = []
    for attempt in range(10):
        receiver = Receiver(root)
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=30.0) as sock:
            sock.sendall(_head(len(data)) + data)
            took, out, _ = receiver.stop(timeout=10.0)
            answer = _answer(sock)
        summary = any(line.startswith("received in ") for line in out.splitlines())
        takes.append(took)
        print(
            f"  try {attempt + 1}: exited {took:.3f} s after SIGTERM, status "
            f"{receiver.proc.returncode}, summary printed: {summary}, the request got "
            f"{_first(answer)!r}"
        )
    print(f"slowest {max(takes):.3f} s, median {sorted(takes)[5]:.3f} s")


def flood(root: Path) -> None:
    data = _traces(100_000)
    print(f"3 senders of {len(data) / 2**20:.2f} MiB requests, without a pause; SIGTERM after 1 s")
    takes = []
    for attempt in range(10):
        receiver = Receiver(root)
        halt = threading.Event()

        def send(port: int = receiver.port, halt: threading.Event = halt) -> None:
            while not halt.is_set():
                try:
                    _send(port, _head(len(data)) + data, timeout=2.0)
                except OSError:
                    time.sleep(0.01)

        senders = [threading.Thread(target=send, daemon=True) for _ in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(1.0)
        took, out, _ = receiver.stop(timeout=3.0)
        halt.set()
        for sender in senders:
            sender.join(5.0)
        summary = [line for line in out.splitlines() if line.startswith("received in ")]
        takes.append(took)
        ended = (
            "still ran 3 s after SIGTERM (killed)"
            if took == float("inf")
            else f"exited {took:.3f} s after SIGTERM"
        )
        print(f"  try {attempt + 1}: {ended}; summary: {summary[0][:80] if summary else None}")
    print(f"slowest {max(takes):.3f} s")


PROBES = {
    "length": length,
    "body": body,
    "bomb": bomb,
    "half": half,
    "sigterm": sigterm,
    "flood": flood,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.receive_limits")
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    args = parser.parse_args(argv)
    PROBES[args.probe](args.root.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
