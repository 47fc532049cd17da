"""Render benchmark JSON results as markdown tables, and refresh ``BENCHMARKS.md`` with them.
``python -m benchmarks.report DIR [--write BENCHMARKS.md]`` replaces what lies between
``<!-- BEGIN bench:X -->`` and ``<!-- END bench:X -->`` for every section X it has results for."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.suites import BENCHMARKS, SUITES
from benchmarks.table import Table, bar, markdown, measured, verdict

__all__ = ["GOALS", "Table", "markdown_sections", "text_summary", "update_document"]

#: The performance goals, in the order the goals table lists them: key -> what it asks. A
#: target or figure belongs to one when its ``goal`` field names the key.
GOALS: dict[str, str] = {
    "hit_path": "Hit path within 3 us of host time and 1 % of the bare copy-replay-clone at "
    "every shape, torch and vLLM backends (and with the bus's folds on)",
    "compiled": "Compiled graphs (opt-in switch): faster than the bare graph and than "
    "reduce-overhead on audio; outputs within the documented tolerance of eager",
    "observability": "Observability under 1 % of throughput with the production sinks "
    "(OTel, logs, JSONL)",
    "coverage_costs": "Hit-path cost of the bus's folds (stats and per-signature coverage) and "
    "of CUDA-event device timing, measured",
}
#: Goals of benchmarks outside the ``all`` suite: (benchmark, text), listed only when that
#: benchmark's results are rendered.
OWN_SUITE_GOALS: dict[str, tuple[str, str]] = {
    "eventlog_scale": (
        "eventlog",
        "Event-log tools at production scale: peak memory flat in the log's size (at most "
        "300 MB at 10M events); at 1M events top within 10 s, replay within 20 s, advise "
        "(default grid) within 60 s; all three complete at 10M",
    ),
    "end_to_end": (
        "engine",
        "vllm serve end to end: TTFT p50 at concurrency 1 below eager encoders' by at least "
        "30 % for Qwen2.5-Omni's images and audio, and for MiniCPM-o 20 % on single-piece "
        "images, 10 % on every image kind, 25 % on audio; ahead of vLLM's own encoder graphs "
        "where both apply; KV cache no smaller than without graphs by more than the pools' "
        "bytes",
    ),
}
#: Statuses of a benchmark that did not fail (a failed one's result renders under a banner).
_RENDERED = ("ok", "partial")
#: The module that renders each benchmark's tables (its ``tables(result)``).
RENDERERS: dict[str, str] = {
    **{name: f"benchmarks.{name}_report" for name in ("engine", "overhead", "latency")},
    **{name: f"benchmarks.{name}" for name in ("eventlog", "memory", "observability")},
}


def _text(table: Table) -> str:
    widths = [
        max(len(c) for c in column) for column in zip(table.headers, *table.rows, strict=True)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [table.title, fmt.format(*table.headers), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*row) for row in table.rows])


def _suffix(payload: dict[str, Any]) -> str:
    return {"partial": " (partial run)", "ok": ""}.get(str(payload.get("status")), " (failed run)")


def _targets_table(outputs: dict[str, dict[str, Any]]) -> Table:
    t = Table("Targets", ["benchmark", "target", "measured", "limit", "status"])
    for name, payload in outputs.items():
        if payload.get("status") not in _RENDERED:
            t.rows.append([name, "(benchmark failed)", payload.get("error") or "", "", "ERROR"])
        for tg in (payload.get("result") or {}).get("targets", []):
            t.rows.append(
                [name, tg["name"] + _suffix(payload), measured(tg), bar(tg), verdict(tg["met"])]
            )
    return t


def _goals_table(outputs: dict[str, dict[str, Any]]) -> Table:
    """List every goal with the checks and figures that belong to it, and their verdicts."""
    t = Table("Goals", ["goal", "check", "measured", "bar", "verdict"])
    goals = dict(GOALS)
    goals.update({goal: text for goal, (name, text) in OWN_SUITE_GOALS.items() if name in outputs})
    entries: dict[str, list[tuple[str, dict[str, Any], bool]]] = {g: [] for g in goals}
    for payload in outputs.values():
        result = payload.get("result") or {}
        for key, is_target in (("targets", True), ("figures", False)):
            for item in result.get(key, []):
                if item.get("goal") in entries:
                    entries[item["goal"]].append((_suffix(payload), item, is_target))
    for goal, text in goals.items():
        if not entries[goal]:
            t.rows.append([text, "(no check in these results)", "", "", "not measured"])
        for i, (suffix, item, is_target) in enumerate(entries[goal]):
            unit = f" {item['unit']}" if item["unit"] else ""
            if is_target:
                limit, status = bar(item), verdict(item["met"])
            else:
                limit, status = "-", "reported" if item["value"] is not None else "not measured"
            cells = [text if i == 0 else "", item["name"] + suffix, measured(item, unit), limit]
            t.rows.append([*cells, status])
    t.note = (
        "Each check's note in the benchmark's JSON says how it was measured and where it "
        "was not. 'reported': a cost the goal asks to measure, with no bar of its own."
    )
    return t


def _environment(outputs: dict[str, dict[str, Any]]) -> str:
    env = next(iter(outputs.values()))["environment"]
    parts = [
        f"- Date (UTC): {env.get('date_utc')}",
        f"- Command: `{env.get('command')}`",
        f"- GPU: {env.get('gpu') or 'none'} (driver {env.get('driver') or 'n/a'}), torch "
        f"{env.get('torch')} (CUDA {env.get('torch_cuda') or 'n/a'}), Python {env.get('python')}",
        f"- omnitrace {env.get('omnitrace')} at {env.get('git_commit') or 'unknown commit'}; "
        f"scale {env.get('scale')}",
    ]
    runs: dict[tuple[Any, ...], list[str]] = {}
    for name, payload in outputs.items():
        e = payload.get("environment") or {}
        runs.setdefault((e.get("date_utc"), e.get("command"), e.get("git_commit")), []).append(name)
    if len(runs) > 1:
        # Results gathered from several runs: say which run measured what.
        parts[3] = f"- omnitrace {env.get('omnitrace')}; scale {env.get('scale')}"
        parts[:2] = ["- Runs (the results below combine them):"] + [
            f"  - {date}: `{command}` at {commit or 'unknown commit'}: {', '.join(names)}"
            for (date, command, commit), names in runs.items()
        ]
    if env.get("simulated"):
        parts.append("- SIMULATED on CPU: the numbers check the plumbing and mean nothing.")
    return "\n".join(parts)


def load(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Read every ``<benchmark>.json`` in ``out_dir``: the ``all`` suite's first, in order."""
    names = dict.fromkeys([*BENCHMARKS, *(n for suite in SUITES.values() for n in suite)])
    paths = [out_dir / f"{name}.json" for name in names]
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in paths if p.exists()}


def _tables_for(name: str, payload: dict[str, Any]) -> list[Table]:
    if payload.get("result") is None:
        return []
    return list(importlib.import_module(RENDERERS[name]).tables(payload["result"]))


def markdown_sections(outputs: dict[str, dict[str, Any]], image_dir: str = "") -> dict[str, str]:
    """``{section: markdown}`` for ``environment``, ``goals``, ``targets`` and each benchmark;
    ``image_dir`` is the plots' folder as the document's links name it."""
    if not outputs:
        return {}
    sections = {
        "environment": _environment(outputs),
        "goals": markdown(_goals_table(outputs)),
        "targets": markdown(_targets_table(outputs)),
    }
    for name, payload in outputs.items():
        failed = f"`{payload.get('error')}` (see `{name}.json`)"
        if payload.get("status") not in _RENDERED and payload.get("result") is None:
            sections[name] = f"Failed: {failed}."
            continue
        body = "\n\n".join(markdown(t) for t in _tables_for(name, payload))
        if payload.get("status") not in _RENDERED:
            body = f"_Failed: {failed}; what it measured follows._\n\n{body}"
        if payload.get("status") == "partial":
            body = f"_Partial: the run stopped before {name} finished._\n\n{body}"
        if plots := payload.get("plots"):
            prefix = f"{image_dir.rstrip('/')}/" if image_dir else ""
            body += "\n\n" + "\n".join(f"![{name}]({prefix}{Path(p).name})" for p in plots)
        sections[name] = body
    return sections


def text_summary(outputs: dict[str, dict[str, Any]]) -> str:
    """The plain-text summary the runner prints at the end."""
    lines = ["", "== summary"]
    for name, payload in outputs.items():
        error = f": {payload['error']}" if payload.get("error") else ""
        lines.append(
            f"{name}: {payload.get('status')} in {payload.get('duration_s', 0):.1f} s{error}"
        )
    lines.append("")
    tables = _tables_for("latency", outputs["latency"]) if "latency" in outputs else []
    if tables:
        lines += [_text(tables[0]), ""]
    return "\n".join([*lines, _text(_goals_table(outputs)), "", _text(_targets_table(outputs))])


_SECTION = re.compile(
    r"(<!-- BEGIN bench:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- END bench:(?P=name) -->)",
    re.DOTALL,
)


def update_document(text: str, sections: dict[str, str]) -> str:
    """Replace the marked sections of ``text`` that ``sections`` has content for."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in sections:
            return match.group(0)
        return f"{match.group(1)}{sections[name].rstrip()}\n{match.group(4)}"

    return _SECTION.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Render benchmark JSON results as markdown tables.",
    )
    parser.add_argument("results", type=Path, help="folder written by benchmarks.run --out")
    parser.add_argument("--write", type=Path, help="update the marked sections of this file")
    only = (
        "comma-separated sections to render or write (default: all it has results for), "
        "e.g. eventlog: a CPU run beside the GPU machine's tables"
    )
    parser.add_argument("--only", help=only)
    args = parser.parse_args(argv)
    outputs = load(args.results)
    if not outputs:
        print(f"error: no benchmark results (*.json) in {args.results}", file=sys.stderr)
        return 2
    image_dir = ""
    if args.write is not None:
        # Links in the document are relative to the document's own folder.
        image_dir = os.path.relpath(args.results.resolve(), args.write.resolve().parent)
    sections = markdown_sections(outputs, image_dir)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        sections = {name: body for name, body in sections.items() if name in wanted}
    if args.write is None:
        for name, body in sections.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    text = args.write.read_text(encoding="utf-8")
    args.write.write_text(update_document(text, sections), encoding="utf-8")
    print(f"updated {', '.join(sections)} in {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
