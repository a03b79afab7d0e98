"""bench/run.py's jobs scenario: every system runs both workloads, the no-op jobs'
completion marks, and the ratios and report the docs quote."""

import multiprocessing

import pytest

from bench import run
from bench.peers import common


def _mark_all(path: str, seqs: list[int]) -> None:
    marks = common.Marks.open(path)
    for seq in seqs:
        marks.mark(seq)


def test_the_marks_count_each_job_once_across_processes_and_see_a_second_run():
    marks = common.Marks.create(10)
    try:
        ctx = multiprocessing.get_context("spawn")
        workers = [
            ctx.Process(target=_mark_all, args=(str(marks.path), seqs))
            for seqs in ([0, 2, 4, 6, 8], [1, 3, 5, 7], [7])  # job 7 runs twice
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
            assert w.exitcode == 0

        counts = marks.counts()
    finally:
        marks.close(unlink=True)

    assert counts["distinct_webhook_ids"] == 9  # job 9 never ran
    assert counts["requests"] == 10
    assert 0 < counts["first_at"] <= counts["last_at"]
    assert not marks.path.exists()


def test_both_workloads_give_each_system_its_arguments():
    assert common.job_arguments("noop", 7) == {"seq": 7}
    post = common.job_arguments("post", 7)
    assert post["msg_id"] == "msg_7"
    assert len(common.encode(post["data"])) == common.BODY_SIZE
    assert set(common.TASK_NAMES) == set(common.WORKLOADS) == set(run.JOB_WORKLOADS)


def _run(per_second: float) -> dict:
    return {
        "per_second": per_second,
        "events": 1000,
        "steady_jobs": 1000,
        "steady_worker_cpu_seconds": 0.5,
    }


def test_the_scenario_runs_every_system_with_each_workload(monkeypatch):
    calls = []

    def fake_peer(name, script, extra, n, ctx):
        calls.append((extra[extra.index("--workload") + 1], name, script, tuple(extra)))
        return _run(1000.0)

    def fake_service(workload, n, ctx, *, sync=False, env=None):
        name = run.SERVICE_SYNC if sync else run.SERVICE_UNPREPARED if env else "service"
        calls.append((workload, name, None, tuple(sorted((env or {}).items()))))
        return _run(4000.0)

    monkeypatch.setattr(run, "run_peer", fake_peer)
    monkeypatch.setattr(run, "run_service_jobs", fake_service)
    ctx = {"jobs_events": 1000, "repeat": 2, "skip_peers": set()}

    out = run.scenario_jobs(ctx)

    systems = {"service", run.SERVICE_UNPREPARED, run.BASELINE_SKIP_LOCKED, *run.PEERS}
    for workload in run.JOB_WORKLOADS:
        ran = [c for c in calls if c[0] == workload]
        expected = systems | ({run.SERVICE_SYNC} if workload == "noop" else set())
        assert {c[1] for c in ran} == expected
        assert len(ran) == 2 * len(expected)  # each system once per repeat
        assert set(out["workloads"][workload]["median_per_second"]) == expected
    unprepared = ("post", run.SERVICE_UNPREPARED, None, (("DATABASE_PREPARE_THRESHOLD", "0"),))
    assert unprepared in calls
    # Each peer keeps its own flags (the django-q2 broker) beside the workload's.
    assert ("noop", "django-q2 Redis", "djq.py", ("--broker", "redis", "--workload", "noop")) in (
        calls
    )


def test_the_ratios_are_taken_within_each_repeat_against_that_repeats_fastest_peer():
    runs = {
        "noop": {
            "service": [_run(8000.0), _run(6000.0), _run(9000.0)],
            run.BASELINE_SKIP_LOCKED: [_run(20000.0), _run(10000.0), _run(20000.0)],
            "procrastinate": [_run(1000.0), _run(2000.0), _run(1000.0)],
            "Celery Redis": [_run(2000.0), _run(1000.0), _run(1500.0)],
        },
        "post": {
            "service": [_run(3000.0)],
            run.BASELINE_SKIP_LOCKED: [_run(4000.0)],
            "procrastinate": [_run(500.0)],
        },
    }

    out = run.jobs_summary(runs, ["procrastinate", "Celery Redis", "django-q2 ORM"])

    noop = out["noop"]
    # Per repeat: 8000/2000, 6000/2000, 9000/1500, whichever peer was fastest then.
    assert noop["ratios"]["service_over_fastest_peer"] == 4.0
    assert noop["ratios"]["service_over_skip_locked"] == 0.45  # 0.4, 0.6, 0.45
    assert noop["ratios"]["service_over_Celery Redis"] == 6.0  # 4, 6, 6
    assert noop["fastest_peer"] in ("procrastinate", "Celery Redis")
    assert noop["meets"] == {"service_over_fastest_peer": True, "service_over_skip_locked": False}
    post = out["post"]
    assert post["fastest_peer"] == "procrastinate"
    assert post["ratios"]["service_over_fastest_peer"] == 6.0
    assert post["meets"] == {"service_over_fastest_peer": True, "service_over_skip_locked": True}


def test_the_report_states_both_ratios_for_both_workloads():
    runs = {
        "noop": {
            "service": [_run(8000.0)],
            run.SERVICE_SYNC: [_run(4000.0)],
            run.BASELINE_SKIP_LOCKED: [_run(20000.0)],
            "procrastinate": [_run(1000.0)],
        },
        "post": {
            "service": [_run(3000.0)],
            run.BASELINE_SKIP_LOCKED: [_run(4000.0)],
            "procrastinate": [_run(1000.0)],
        },
    }
    jobs = {
        "events": 1000,
        "service": {"processes": 2, "concurrency": {"noop": 64, "post": 64}},
        "targets": run.JOBS_TARGETS,
        "workloads": run.jobs_summary(runs, ["procrastinate"]),
    }

    text = "\n".join(run.jobs_markdown(jobs, {"procrastinate": "procrastinate 3.10.0"}))

    assert "Service ÷ fastest peer: no-op **8.00** (procrastinate), one POST **3.00**" in text
    assert "target ≥ 4: met, NOT met" in text
    assert "Service ÷ bare SKIP LOCKED: no-op **0.40**, one POST **0.75**" in text
    assert "target ≥ 0.5: NOT met, met" in text
    assert "| **service** | 8,000 |  | 500 / n/a | 3,000 |  |" in text
    assert "| procrastinate | 1,000 | 8.00 |" in text


@pytest.mark.parametrize(
    "scenario, stem",
    [("jobs", "jobs"), ("throughput", "results"), ("growth", "results")],
)
def test_the_jobs_scenario_has_a_results_file_of_its_own(scenario, stem):
    assert run.results_file(scenario) == stem
