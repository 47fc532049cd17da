"""Write event logs of MiniCPM-o-shaped serving traffic (the demo's mix, the adapter's own
admission, a device timing per call) with the writer's own codec, without torch or a bus."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path

from benchmarks.table import GiB, MiB
from omnitrace import events as ev
from omnitrace.config import EncoderGraphConfig
from omnitrace.demo.traffic import TrafficMix
from omnitrace.eventlog import INFO_TYPE, SCHEMA_VERSION, LineEncoder, dumps
from omnitrace.events import MissReason, Phase
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.signature import InputSpec, Signature

__all__ = ["GENERATOR_VERSION", "write_log"]

#: Bumped whenever the traffic or the lines change, so a cached log is written anew.
GENERATOR_VERSION = 1

#: SigLIP's hidden size and Whisper's mel bins (MiniCPM-o 4.5).
VISION_HIDDEN = 1152
MEL_BINS = 80
DEVICE = "cuda:0"
STREAM = 94
PID = 4242
#: Device-free memory at the worker's start, and the floor a capture must leave.
FREE_AT_START = GiB + 400 * MiB
FLOOR = GiB
CONFIG = EncoderGraphConfig(max_graphs=16, min_capture_calls=2, min_free_bytes=FLOOR)
#: The burst of new shapes starts at this share of the calls, as in the demo.
BURST_AT = 0.85


_REASON = {v: MissReason[v.name] for v in (Verdict.CAPACITY, Verdict.WARMUP, Verdict.MEMORY)}
#: The adapter's details of admission misses (a warm-up miss says which call it was).
_DETAIL = {MissReason.CAPACITY: "cap", MissReason.MEMORY: "floor"}


def _signature(kind: str, batch: int, length: int, masked: bool) -> Signature:
    if kind == "vision":
        hidden = InputSpec("bfloat16", (batch, length, VISION_HIDDEN), DEVICE)
        mask = InputSpec("bool", (batch, 1, length, length), DEVICE) if masked else None
        return Signature((hidden, mask), STREAM)
    return Signature((InputSpec("bfloat16", (batch, MEL_BINS, length), DEVICE),), STREAM)


class _Worker:
    """One worker's adapters, replaying the mix and yielding the events they would emit."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed + 1)
        self.admission = {name: Admission(CONFIG) for name in ("vision", "audio")}
        self.graphs: dict[str, set[Signature]] = {"vision": set(), "audio": set()}
        self.signatures: dict[tuple[str, int, int, bool], Signature] = {}
        self.free = FREE_AT_START
        self.clock = 1_000_000_000
        self.epoch = 1_764_633_600_000_000_000  # 2025-12-02 00:00 UTC
        self.pool = {"vision": 1, "audio": 2}

    def _stamp(self) -> tuple[int, int]:
        self.clock += self.rng.randrange(200_000, 9_000_000)
        return self.clock, self.epoch + self.clock

    def call(
        self, kind: str, batch: int, length: int, masked: bool, phase: Phase
    ) -> list[ev.Event]:
        """The events of one call."""
        adapter = "audio" if kind == "streaming" else kind
        ident = (kind, batch, length, masked)
        signature = self.signatures.get(ident)
        if signature is None:
            signature = self.signatures[ident] = _signature(adapter, batch, length, masked)
        rng = self.rng
        numel = sum(spec.numel for spec in signature.inputs if spec is not None)
        eager_s = 0.0035 + numel * 2.2e-10 + rng.random() * 4e-4
        replay_s = eager_s * (0.35 + rng.random() * 0.1)
        out: list[ev.Event] = []
        if kind == "streaming":  # stateful audio (KV-cached chunks): never graphed
            mono, epoch = self._stamp()
            reason = (MissReason.INELIGIBLE, "streaming")
            return [ev.missed(adapter, signature, mono, epoch, *reason, eager_s, phase)]
        if signature in self.graphs[adapter]:
            return self._timed(out, adapter, signature, replay_s, phase)
        admission = self.admission[adapter]
        decision = admission.decide(signature, lambda: self.free)
        verdict = decision.verdict
        if verdict is Verdict.CAPTURE:
            stamps = self._stamp()
            reserved, static = numel * 16 + 8 * MiB, numel * 4
            placed = (0.4 + rng.random() * 0.3, self.pool[adapter], DEVICE, STREAM, STREAM + 1)
            sizes = (reserved, static, admission.num_graphs, self.free)
            out.append(ev.GraphCaptured(adapter, signature, *stamps, *placed, *sizes, phase=phase))
            admission.captured(signature)
            self.graphs[adapter].add(signature)
            self.free -= reserved + static
            return self._timed(out, adapter, signature, replay_s, phase)
        if verdict is Verdict.MEMORY:
            where = (self.free, FLOOR, DEVICE)
            out.append(ev.MemoryDeferred(adapter, signature, *self._stamp(), *where, phase=phase))
        reason = _REASON[verdict]
        detail = _DETAIL.get(reason) or f"call {decision.calls} of {CONFIG.min_capture_calls}"
        return self._timed(out, adapter, signature, eager_s, phase, miss=(reason, detail))

    def _timed(
        self,
        out: list[ev.Event],
        adapter: str,
        signature: Signature,
        host_s: float,
        phase: Phase,
        *,
        miss: tuple[MissReason, str] | None = None,
    ) -> list[ev.Event]:
        """Add the call's hit or miss (``miss``) and its device time to ``out``."""
        mono, epoch = self._stamp()
        if miss is None:
            out.append(ev.replayed(adapter, signature, mono, epoch, host_s, phase))
        else:
            reason, detail = miss
            out.append(ev.missed(adapter, signature, mono, epoch, reason, detail, host_s, phase))
        device_s = host_s * (0.9 + self.rng.random() * 0.08)
        kind = "replay" if miss is None else "eager"
        stamps = (mono + 1000, epoch + 1000)
        out.append(ev.DeviceTimed(adapter, signature, *stamps, kind, device_s, phase=phase))
        return out


def _info_lines() -> bytes:
    copied = ("max_graphs", "min_capture_calls", "min_free_bytes", "share_pools", "compile")
    info = {
        "enabled": True,
        **{f: getattr(CONFIG, f) for f in (*copied, "background_capture")},
        "device_timing": True,
        "skip_profiling": CONFIG.skip_profiling,
        "backend": "torch",
        "simulated": False,
    }
    head = {"v": SCHEMA_VERSION, "type": INFO_TYPE, "pid": PID, "rank": 0}
    return b"".join(dumps({**head, "adapter": a, "info": info}) for a in ("vision", "audio"))


def traffic_events(events: int, seed: int = 0) -> Iterator[ev.Event]:
    """``events`` events of one worker: vLLM's start-up profiling run (maximum-size dummy
    inputs, once per encoder), then the serving mix."""
    worker = _Worker(seed)
    mix = TrafficMix(seed)
    produced = 0

    def calls() -> Iterator[ev.Event]:
        yield from worker.call("vision", 10, 1024, False, Phase.PROFILING)
        yield from worker.call("audio", 1, 3000, False, Phase.PROFILING)
        while True:
            r = mix.next(burst=produced >= BURST_AT * events)
            yield from worker.call(r.kind, r.batch, r.length, r.masked, Phase.SERVING)

    for event in itertools.islice(calls(), events):
        produced += 1
        yield event


def write_log(path: Path, events: int, seed: int = 0) -> None:
    """Write a log of ``events`` events to ``path`` (atomically: a partial log never stays)."""
    encode = LineEncoder(pid=PID, rank=0)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:
        file.write(_info_lines())
        batch: list[bytes] = []
        for event in traffic_events(events, seed):
            batch.append(encode(event))
            if len(batch) >= 4096:
                file.write(b"".join(batch))
                batch.clear()
        file.write(b"".join(batch))
    os.replace(partial, path)
