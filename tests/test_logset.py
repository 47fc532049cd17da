"""The logs a reader is given: paths, and the patterns omnitrace expands itself."""

from __future__ import annotations

from pathlib import Path

from omnitrace.eventlog.patterns import LogSet, expand, is_pattern


def _touch(*paths: Path) -> None:
    for path in paths:
        path.write_text("")


def test_a_quoted_pattern_expands_to_its_logs_sorted_without_rotated_files(tmp_path: Path) -> None:
    """'events-*' gives each rank's log once, in sorted order; a match that is a rotated file
    of another match is read with its log, so it is left out."""
    logs = [tmp_path / f"events-{rank}.jsonl" for rank in (1, 0)]
    _touch(*logs, tmp_path / "events-0.jsonl.1", tmp_path / "other.jsonl")
    assert expand([tmp_path / "events-*"]) == sorted(logs)
    assert expand([tmp_path / "events-?.jsonl"]) == sorted(logs)


def test_paths_and_patterns_keep_their_order_and_each_log_comes_once(tmp_path: Path) -> None:
    """A log named and matched again is read once, where it first came."""
    one, two = tmp_path / "a-1.jsonl", tmp_path / "a-2.jsonl"
    _touch(one, two)
    assert expand([two, tmp_path / "a-*.jsonl"]) == [two, one]


def test_an_existing_file_is_never_a_pattern(tmp_path: Path) -> None:
    """A file whose name holds a '*' is read as it is, not matched against its siblings."""
    odd = tmp_path / "events-*.jsonl"
    _touch(odd, tmp_path / "events-0.jsonl")
    assert not is_pattern(odd)
    assert expand([odd]) == [odd]


def test_a_pattern_that_matches_nothing_is_left_for_the_reader_to_report(tmp_path: Path) -> None:
    """No match: the pattern stays, so the reader names it in its error."""
    pattern = tmp_path / "events-*.jsonl"
    assert is_pattern(pattern)
    assert expand([pattern]) == [pattern]


def test_a_log_set_finds_a_log_that_appears_after_it_started(tmp_path: Path) -> None:
    """While following, a new match (a rank that started late) is returned once."""
    _touch(tmp_path / "events-0.jsonl")
    logs = LogSet([tmp_path / "events-*.jsonl"], rescan_s=0)
    assert logs.paths == [tmp_path / "events-0.jsonl"]
    assert logs.new_paths() == []
    _touch(tmp_path / "events-1.jsonl", tmp_path / "events-1.jsonl.1")
    assert logs.new_paths() == [tmp_path / "events-1.jsonl"]
    assert logs.new_paths() == []
    assert logs.paths == [tmp_path / "events-0.jsonl", tmp_path / "events-1.jsonl"]


def test_a_log_set_of_plain_paths_never_scans(tmp_path: Path) -> None:
    """Without a pattern there is nothing to look for: no scan, whatever appears."""
    path = tmp_path / "events.jsonl"
    logs = LogSet([path], rescan_s=0)
    _touch(path, tmp_path / "events-1.jsonl")
    assert logs.new_paths() == []
    assert logs.paths == [path]
