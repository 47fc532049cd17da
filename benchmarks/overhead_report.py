"""The overhead benchmark's tables in ``BENCHMARKS.md``, rendered by :mod:`benchmarks.report`."""

from __future__ import annotations

from typing import Any

from benchmarks.table import Table, ns, us


def tables(result: dict[str, Any]) -> list[Table]:
    emit = result["emit"]
    t = Table(
        "EventBus.emit() cost",
        ["subscribers", "median ns/emit", "p10", "p90", "thread CPU ns/emit", "dropped"],
    )
    for row in emit["rows"]:
        s, cpu = row["per_emit_us"], row.get("per_emit_cpu_us")
        label = f"{row['count']} no-op {row['subscribers']}" if row["count"] else ""
        cells = [ns(s["median"]), ns(s["p10"]), ns(s["p90"]), ns(cpu["median"]) if cpu else "n/a"]
        t.rows.append([label or "the bus's fold only", *cells, str(row["dropped"])])
    alone = emit.get("bus_fold_us")
    fold = f"; called directly it costs {ns(alone['median'])} ns" if alone else ""
    t.note = (
        "The bus's own fold (per-signature coverage, which applies each event to the stats) "
        f"runs in every row{fold}. Python loop cost "
        f"{ns(emit['loop_overhead_us']['median'])} ns/iteration is included. "
        "Wall time per emit adds the time the emitting thread waited while the sink threads "
        "held the GIL; the thread's CPU time does not."
    )
    thr = Table(
        "Bus throughput",
        ["path", "events", "M events/s (end to end)", "M events/s (emit side)", "dropped"],
    )
    fold_alone = result["fold"]
    rate = f"{fold_alone['events_per_s'] / 1e6:.2f}"
    thr.rows.append(["StatsFold.fold alone", f"{fold_alone['events']:,}", rate, "", "0"])
    for row in result["throughput"]["rows"]:
        path = f"emit + flush, {row['sinks']} {row['config']}" if row["sinks"] else ""
        rates = [f"{row[k] / 1e6:.2f}" for k in ("events_per_s", "emit_events_per_s")]
        thr.rows.append(
            [path or "emit, the bus's fold only", f"{row['events']:,}", *rates, str(row["dropped"])]
        )
    hp = result["hit_path"]["split_us"]
    split = Table(
        "Adapter hit path, host time per call (simulated backend, no device work)",
        ["part", "median us"],
        [
            [part, us(hp[key], 2)]
            for part, key in (
                ("admission, key building, event, own stats", "admission_key"),
                ("copy-in, output copy, clone", "copy_clone"),
                ("emit (bus with stats fold)", "emit"),
                ("emit (bus with one no-op sink)", "emit_with_sink"),
                ("total (with bus)", "total"),
            )
        ],
        "Differences of medians of interleaved rounds; a part can be slightly negative "
        "at noise level.",
    )
    return [t, thr, split, _cuda(result.get("cuda", {}))]


def _cuda(cuda: dict[str, Any]) -> Table:
    if "skipped" in cuda:
        return Table("Adapter hit vs bare graph on CUDA", ["skipped"], [[cuda["skipped"]]])
    t = Table(
        f"Adapter hit vs bare copy-replay-clone on CUDA ({cuda['encoder']}, "
        f"input {tuple(cuda['input_shape'])})",
        ["path", "host us/call", "over bare", "latency us/call", "over bare"],
    )
    bare = cuda["timings"]["bare"]
    for name, tm in cuda["timings"].items():
        cells = []
        for key in ("host_us", "latency_us"):
            cells += [us(tm[key]["median"]), us(tm[key]["median"] - bare[key]["median"])]
        t.rows.append([name, *cells])
    t.note = "Host: from call to return (device idle before). Latency: until the device finished."
    return t
