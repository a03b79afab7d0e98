"""bench/run.py's throughput scenario beyond the rates: the settings it runs the service
with, the CPU per delivery against the bare loop's per request, and the rows of the Redis
broker and of four worker processes (each process's share, none sent twice)."""

import json

import pytest

from bench import run
from deliveries.core.conf import DEFAULTS


def test_the_service_runs_the_defaults_but_for_the_settings_the_harness_names():
    pipeline = run.service_pipeline({})
    worker = dict(pipeline.commands())["workers0"]

    assert "--lanes" not in worker  # WORKER_LANES
    assert worker[worker.index("--batch-size") + 1] == str(run.SERVICE_BATCH_SIZE)
    assert worker[worker.index("--concurrency") + 1] == str(run.SERVICE_CONCURRENCY)
    assert pipeline.env == run.SERVICE_ENV
    # Each setting the harness changes is one the product has, set to another value.
    for name, value in run.SERVICE_ENV.items():
        assert str(DEFAULTS[name]) != value
    defaults = run.default_pipeline({})
    assert dict(defaults.commands())["workers0"][-1] == "run_workers"
    assert defaults.env == {}


def test_cpu_per_delivery_counts_every_process_against_the_bare_request():
    n = 10_000
    bare = {"per_second": 5_000.0, "cpu_seconds": {"client": 1.0, "receiver": 1.0}}  # 200 µs
    service = {
        "cpu_seconds": {
            "scheduler": 0.2,
            "relay": 0.1,
            "workers0": 0.9,
            "workers1": 0.8,
            "bench_poller": 5.0,  # the harness's own: not the service's
            "receiver": 1.0,
            "postgres_by_app": {"bench-workers0": 0.5},
            "postgres_backends": 0.5,
            "postgres_all": 1.0,
        }
    }

    assert run.cpu_over_bare_loop(bare, service, n) == {
        "service_cpu_us": 400.0,  # (2.0 pipeline + 1.0 receiver + 1.0 PostgreSQL) / N
        "bare_request_cpu_us": 200.0,
        "ratio": 2.0,
    }
    assert run.cpu_over_bare_loop(bare, {"cpu_seconds": {"receiver": 1.0}}, n) is None


def _spread_run(requests: int, attempts: int, by_worker: dict) -> dict:
    return {
        "receiver_requests": requests,
        "duplicates": requests - 100,
        "attempts": attempts,
        "attempts_by_worker": by_worker,
    }


def test_the_spread_row_reports_each_process_share_and_fails_on_a_second_copy():
    shares = {"workers0": 40, "workers1": 30, "workers2": 30}
    assert run.spread_check(_spread_run(100, 100, shares), 100, 4) == {**shares, "workers3": 0}

    with pytest.raises(run.ob.BenchError, match="101 requests"):
        run.spread_check(_spread_run(101, 100, shares), 100, 4)
    with pytest.raises(run.ob.BenchError, match="attempts by process"):
        # One attempt by a process that is none of the four.
        run.spread_check(_spread_run(100, 100, {**shares, "workers2": 29, "host:1": 1}), 100, 4)


@pytest.mark.django_db
def test_attempts_are_counted_by_the_process_that_made_them(tenant):
    from deliveries import services
    from deliveries.models import Attempt, Delivery

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/hook")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    delivery = Delivery.objects.get()
    for number, worker in enumerate(["box:11", "box:11", "box:12", "elsewhere:99"], 1):
        Attempt.objects.create(
            delivery=delivery,
            number=number,
            started_at=delivery.created_at,
            duration_ms=1.0,
            outcome="success",
            worker=worker,
        )

    by_role = run.ob.attempts_by_process([("workers0", Proc(11)), ("workers1", Proc(12))])

    assert by_role == {"elsewhere:99": 1, "workers0": 2, "workers1": 1}


def test_the_cpu_ratio_is_the_median_of_the_repeats_against_the_target():
    n = 10_000
    bare = {"cpu_seconds": {"client": 1.0, "receiver": 1.0}}  # 200 µs a request
    services = [
        {"cpu_seconds": {"workers0": w, "receiver": 1.0, "postgres_all": 1.0}}
        for w in (1.0, 1.4, 2.0)  # 300, 340, 400 µs a delivery
    ]
    systems = {"bare aiohttp loop": [bare] * 3, "service": services}

    summary = run.cpu_summary(systems, n)

    assert [r["ratio"] for r in summary["runs"]] == [1.5, 1.7, 2.0]
    assert (summary["ratio"], summary["meets"]) == (1.7, False)
    systems["service"] = services[:1]
    assert run.cpu_summary(systems, n)["meets"] is True


def test_the_results_state_the_redis_broker_the_spread_and_the_cpu_ratio():
    result = json.loads((run.RESULTS / "results.json").read_text())
    tp = result["scenarios"]["throughput"]
    tp["ratios"].update({"redis_broker_over_bare_loop": 0.45, "spread_over_bare_loop": 0.5})
    tp["runs"][run.SERVICE_SPREAD] = [
        {"per_second": 3000.0, "shares": {"workers0": 5_000, "workers1": 15_000}}
    ]
    tp["cpu_over_bare_loop"] = {
        "runs": [{"ratio": 1.5}, {"ratio": 1.7}, {"ratio": 1.8}],
        "service_cpu_us": 500.0,
        "bare_request_cpu_us": 294.0,
        "ratio": 1.7,
        "meets": False,
    }

    text = run.markdown(result)

    assert "Service with the Redis broker ÷ bare loop: **0.45**" in text
    assert f"{run.SPREAD_WORKERS} worker processes, nothing but the database" in text
    assert "(its attempt rows, by repeat): 5,000 / 15,000;" in text
    assert "CPU per delivery ÷ the bare loop's CPU per request: **1.70**" in text
    assert "(repeats 1.50, 1.70, 1.80; target ≤ 1.6: NOT met)" in text
