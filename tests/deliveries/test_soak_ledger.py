"""The soak's job ledger (tests/chaos/soak.py) is only as good as its overlap rule: these
check that rule on runs written by hand, without the soak."""

import json

from tests.chaos.soak import JobRunSpan, lock_overlaps, read_job_runs


def write_runs(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def span(job, start, end, key="soak-entity:1", outcome="ok", attempt=1):
    return JobRunSpan(job, attempt, key, start, end, outcome)


def test_runs_under_one_key_that_intersect_are_an_overlap():
    a, b = span("a", 10.0, 10.2), span("b", 10.1, 10.3)
    assert lock_overlaps([b, a]) == [(a, b)]


def test_back_to_back_runs_and_runs_under_other_keys_are_not():
    runs = [
        span("a", 10.0, 10.2),
        span("b", 10.2, 10.4),
        span("c", 10.1, 10.3, key="soak-entity:2"),
        span("d", 10.1, 10.3, key=""),  # no lock
    ]
    assert lock_overlaps(runs) == []


def test_a_long_run_is_overlapped_by_any_run_that_starts_before_it_ends():
    long, short, late = span("a", 10.0, 12.0), span("b", 10.1, 10.2), span("c", 11.0, 11.1)
    assert lock_overlaps([long, short, late]) == [(long, short), (long, late)]


def test_a_run_cut_by_its_process_death_ends_at_the_death(tmp_path):
    killed, later = tmp_path / "killed.jsonl", tmp_path / "later.jsonl"
    key = "soak-entity:3"
    write_runs(
        killed,
        {"ev": "start", "t": 100.0, "job": "a", "attempt": 1, "key": key},
        {"ev": "end", "t": 100.1, "job": "a", "attempt": 1, "key": key, "outcome": "ok"},
        {"ev": "start", "t": 101.0, "job": "b", "attempt": 1, "key": key},
    )
    write_runs(later, {"ev": "start", "t": 109.5, "job": "b", "attempt": 2, "key": key})
    spans, problems = read_job_runs({killed: 105.0, later: 110.0})
    assert problems == []
    cut = [s for s in spans if s.outcome == "killed"]
    assert sorted((s.job, s.attempt, s.end) for s in cut) == [("b", 1, 105.0), ("b", 2, 110.0)]
    # Taken over after the holder died: no overlap. Before it died: an overlap.
    assert lock_overlaps(spans) == []
    spans, _ = read_job_runs({killed: 109.6, later: 110.0})
    assert [(x.job, y.job) for x, y in lock_overlaps(spans)] == [("b", "b")]


def test_a_run_whose_process_was_never_seen_dead_is_reported(tmp_path):
    path = tmp_path / "alive.jsonl"
    write_runs(path, {"ev": "start", "t": 1.0, "job": "a", "attempt": 1, "key": ""})
    spans, problems = read_job_runs({path: None})
    assert len(problems) == 1 and "not seen dead" in problems[0]
    assert spans[0].end == float("inf")
