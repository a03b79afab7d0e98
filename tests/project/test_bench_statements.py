"""bench/statements.py: the fast path's statements found by name, each call counted in
the stage that made it, and the per-delivery figures made from those counts."""

import pytest

from bench import statements


def test_the_statements_are_found_by_name_in_their_modules():
    from deliveries.jobs import statements as job_machinery
    from deliveries.statements import worker

    names = statements.named_statements()

    assert names[id(worker.LEASE)] == "deliveries.LEASE"
    assert names[id(worker.SUCCEED)] == "deliveries.SUCCEED"
    assert names[id(job_machinery.LOCK_MESSAGES)] == "deliveries.jobs.LOCK_MESSAGES"


def test_a_statement_module_that_is_gone_is_left_out(monkeypatch):
    monkeypatch.setattr(
        statements,
        "STATEMENT_MODULES",
        {"deliveries.statements.worker": "deliveries", "no.such": "gone"},
    )
    assert "deliveries.LEASE" in statements.named_statements().values()


def test_the_figures_are_per_delivery_medians_over_the_repeats():
    n = 100
    runs = [
        {("worker", "deliveries.LEASE"): [1_000_000] * 2, ("setup", "x"): [5]},
        {("worker", "deliveries.LEASE"): [2_000_000] * 2, ("scheduler", "COMMIT"): [100_000]},
        {("worker", "deliveries.LEASE"): [3_000_000] * 2},
    ]

    rows = statements.summarize(runs, n)

    assert rows[0] == {
        "stage": "scheduler",
        "statement": "COMMIT",
        "calls": 0,  # the median of 0, 1, 0 calls
        "per_delivery": 0.0,
        "us_per_call": None,
        "us_per_delivery": 0.0,
    }
    assert rows[1] == {
        "stage": "worker",
        "statement": "deliveries.LEASE",
        "calls": 2,
        "per_delivery": 0.02,
        "us_per_call": 2000.0,
        "us_per_delivery": 40.0,  # 4,000 µs over 100 deliveries
    }
    assert statements.totals(rows)["a delivery"] == {"per_delivery": 0.02, "us_per_delivery": 40.0}
    assert "a job" not in statements.totals(rows)


def test_savepoints_are_one_row_whatever_their_names():
    assert statements.other_sql_name('SAVEPOINT "s140_x1"') == (
        statements.other_sql_name('SAVEPOINT  "s99_x4"')
    )


@pytest.mark.django_db(transaction=True)
def test_a_run_counts_each_stage_statements_and_delivers_every_event():
    from bench import outbound
    from deliveries.statements import admit

    tally = statements.Tally()
    restore = statements.instrument(tally)
    receiver = outbound.start_receiver(None)
    try:
        seconds = statements.run_once(30, receiver, tally)
    finally:
        restore()
        outbound.stop([receiver.proc])

    assert set(seconds) == set(statements.STAGES)
    calls = {key: len(times) for key, times in tally.calls.items()}
    assert calls[("publish", "deliveries.PUBLISH")] == 30  # one per event
    assert calls[("worker", "deliveries.LEASE")] >= 1
    # The worker's take claims the outbox rows (no relay with the database broker) and
    # its recording is one statement.
    assert calls[("worker", "deliveries.jobs.TAKE")] >= 1
    assert calls[("worker", "deliveries.RECORD")] >= 1
    assert not any(stage == "relay" for stage, _ in calls)
    assert calls[("worker", "COMMIT")] >= 1
    assert calls[("enqueue", "deliveries.jobs.INSERT_JOB")] >= 1
    assert calls[("jobs", "deliveries.jobs.CLAIM_JOBS")] >= 1
    assert calls[("jobs", "deliveries.jobs.RECORD_JOBS")] >= 1
    # Undone: a statement called now is not counted.

    before = dict(calls)
    admit.PAUSED_ENDPOINTS()
    assert {key: len(times) for key, times in tally.calls.items()} == before
