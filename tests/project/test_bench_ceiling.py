"""bench/run.py's CPU ceiling of the design's statements and its CPU bound of the design:
the arithmetic the docs quote, and the signed loop the bound is measured with."""

import json

import pytest

from bench import outbound, run


def test_the_ceiling_charges_a_bare_request_and_the_least_postgres_per_delivery():
    n = 20_000
    # 100 µs of client and 80 µs of receiver per request; 220 µs of PostgreSQL per delivery
    # in the service's run, the lesser of the two.
    bare = {"per_second": 10_000.0, "cpu_seconds": {"client": 2.0, "receiver": 1.6}}
    service = {"per_second": 2_900.0, "cpu_seconds": {"postgres_all": 4.4, "receiver": 2.0}}
    floor = {"per_second": 3_000.0, "cpu_seconds": {"postgres_all": 5.0, "receiver": 2.0}}

    ceiling = run.statements_ceiling(bare, [service, floor], n, cores=2)

    assert ceiling == {
        "bare_request_cpu_us": 180.0,
        "postgres_cpu_us": 220.0,
        "per_second": 5_000.0,  # 2 cores / 400 µs
        "over_bare_loop": 0.5,
    }


@pytest.mark.parametrize(
    "bare, drains",
    [
        ({"per_second": 10_000.0}, [{"cpu_seconds": {"postgres_all": 4.4}}]),
        ({"per_second": 10_000.0, "cpu_seconds": {"client": 2.0, "receiver": 1.6}}, [{}]),
        (
            {"per_second": None, "cpu_seconds": {"client": 2.0, "receiver": 1.6}},
            [{"cpu_seconds": {"postgres_all": 4.4}}],
        ),
    ],
)
def test_no_ceiling_without_the_figures_it_needs(bare, drains):
    assert run.statements_ceiling(bare, drains, 20_000, cores=2) is None


def test_the_results_table_states_the_ceiling_and_the_design_bound():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result["scenarios"]["throughput"]["statements_ceiling"] = {
        "bare_request_cpu_us": 180.0,
        "postgres_cpu_us": 220.0,
        "per_second": 5_000.0,
        "over_bare_loop": 0.5,
    }
    result["scenarios"]["throughput"]["design_bound"] = {
        "signed_request_cpu_us": 210.0,
        "postgres_cpu_us": 170.0,
        "scheduler_relay_cpu_us": 20.0,
        "per_second": 4_000.0,
        "over_bare_loop": 0.4,
    }
    result["cpu_count"] = 2

    text = run.markdown(result)

    assert "CPU ceiling of these statements: **0.50** of the bare loop (5,000/s)" in text
    assert "(180 µs: its client and the receiver)" in text
    assert "the lesser of the service's run and the floor's (220 µs); 2 cores busy" in text
    assert "CPU bound of the design: **0.40** of the bare loop (4,000/s)" in text
    assert "(the signed loop's CPU per request, 210 µs with the receiver's)" in text
    assert "(20 µs per delivery in the service's run)" in text


def test_the_design_bound_adds_the_signed_request_and_the_scheduler_and_relay():
    n = 20_000
    bare = {"per_second": 10_000.0, "cpu_seconds": {"client": 2.0, "receiver": 1.6}}
    # 120 µs of client and 90 µs of receiver per signed, checked request.
    signed = {"per_second": 8_000.0, "cpu_seconds": {"client": 2.4, "receiver": 1.8}}
    # 170 µs of PostgreSQL per delivery, the lesser; 20 µs of scheduler and relay.
    service = {
        "per_second": 2_900.0,
        "cpu_seconds": {"postgres_all": 3.4, "scheduler": 0.24, "relay": 0.16},
    }
    floor = {"per_second": 3_000.0, "cpu_seconds": {"postgres_all": 4.0}}

    bound = run.design_bound(bare, signed, service, [service, floor], n, cores=2)

    assert bound == {
        "signed_request_cpu_us": 210.0,
        "postgres_cpu_us": 170.0,
        "scheduler_relay_cpu_us": 20.0,
        "per_second": 5_000.0,  # 2 cores / 400 µs
        "over_bare_loop": 0.5,
    }
    # The bound is never above the ceiling: it charges everything the ceiling does, and more.
    ceiling = run.statements_ceiling(bare, [service, floor], n, cores=2)
    assert ceiling["per_second"] > bound["per_second"]


def test_no_design_bound_without_the_scheduler_and_relay():
    bare = {"per_second": 10_000.0, "cpu_seconds": {"client": 2.0, "receiver": 1.6}}
    signed = {"per_second": 8_000.0, "cpu_seconds": {"client": 2.4, "receiver": 1.8}}
    service = {"per_second": 2_900.0, "cpu_seconds": {"postgres_all": 3.4}}
    assert run.design_bound(bare, signed, service, [service], 20_000, cores=2) is None


def test_the_signed_loop_sends_every_request_with_its_own_webhook_id():
    receiver = outbound.start_receiver(None)
    try:
        result = outbound.run_bare(receiver, 200, 16, signed=True)
        counts = receiver.counts()
    finally:
        outbound.stop([receiver.proc])

    assert result["receiver_requests"] == counts["requests"] == 200
    assert counts["distinct_webhook_ids"] == 200
