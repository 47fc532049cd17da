"""The overhead benchmark's tables in ``BENCHMARKS.md``, rendered by :mod:`benchmarks.report`."""

from __future__ import annotations

from typing import Any

from benchmarks.table import Table, ns, us


def tables(result: dict[str, Any]) -> list[Table]:
    tables: list[Table] = []
    emit = Table(
        "EventBus.emit() cost",
        ["subscribers", "median ns/emit", "p10", "p90", "thread CPU ns/emit", "dropped"],
    )
    for row in result["emit"]["rows"]:
        label = (
            "the bus's fold only"
            if not row["count"]
            else f"{row['count']} no-op {row['subscribers']}"
        )
        s = row["per_emit_us"]
        cpu = row.get("per_emit_cpu_us")
        emit.rows.append(
            [
                label,
                ns(s["median"]),
                ns(s["p10"]),
                ns(s["p90"]),
                ns(cpu["median"]) if cpu else "n/a",
                str(row["dropped"]),
            ]
        )
    emit.note = (
        "The bus's own fold (per-signature coverage, which applies each event to the stats) "
        "runs in every row"
        + (
            f"; called directly it costs {ns(result['emit']['bus_fold_us']['median'])} ns"
            if "bus_fold_us" in result["emit"]
            else ""
        )
        + ". Python loop cost "
        f"{ns(result['emit']['loop_overhead_us']['median'])} ns/iteration is included. "
        "Wall time per emit adds the time the emitting thread waited while the sink threads "
        "held the GIL; the thread's CPU time does not."
    )
    tables.append(emit)

    thr = Table(
        "Bus throughput",
        ["path", "events", "M events/s (end to end)", "M events/s (emit side)", "dropped"],
    )
    fold = result["fold"]
    thr.rows.append(
        [
            "StatsFold.fold alone",
            f"{fold['events']:,}",
            f"{fold['events_per_s'] / 1e6:.2f}",
            "",
            "0",
        ]
    )
    for row in result["throughput"]["rows"]:
        label = (
            "emit, the bus's fold only"
            if not row["sinks"]
            else f"emit + flush, {row['sinks']} {row['config']}"
        )
        thr.rows.append(
            [
                label,
                f"{row['events']:,}",
                f"{row['events_per_s'] / 1e6:.2f}",
                f"{row['emit_events_per_s'] / 1e6:.2f}",
                str(row["dropped"]),
            ]
        )
    tables.append(thr)

    hp = result["hit_path"]["split_us"]
    split = Table(
        "Adapter hit path, host time per call (simulated backend, no device work)",
        ["part", "median us"],
        [
            ["admission, key building, event, own stats", us(hp["admission_key"], 2)],
            ["copy-in, output copy, clone", us(hp["copy_clone"], 2)],
            ["emit (bus with stats fold)", us(hp["emit"], 2)],
            ["emit (bus with one no-op sink)", us(hp["emit_with_sink"], 2)],
            ["total (with bus)", us(hp["total"], 2)],
        ],
        "Differences of medians of interleaved rounds; a part can be slightly negative "
        "at noise level.",
    )
    tables.append(split)

    cuda = result.get("cuda", {})
    if "skipped" in cuda:
        tables.append(Table("Adapter hit vs bare graph on CUDA", ["skipped"], [[cuda["skipped"]]]))
    else:
        t = Table(
            f"Adapter hit vs bare copy-replay-clone on CUDA ({cuda['encoder']}, "
            f"input {tuple(cuda['input_shape'])})",
            ["path", "host us/call", "over bare", "latency us/call", "over bare"],
        )
        bare = cuda["timings"]["bare"]
        for name, tm in cuda["timings"].items():
            over_h = tm["host_us"]["median"] - bare["host_us"]["median"]
            over_l = tm["latency_us"]["median"] - bare["latency_us"]["median"]
            t.rows.append(
                [
                    name,
                    us(tm["host_us"]["median"]),
                    us(over_h),
                    us(tm["latency_us"]["median"]),
                    us(over_l),
                ]
            )
        t.note = (
            "Host: from call to return (device idle before). Latency: until the device finished."
        )
        tables.append(t)
    return tables
