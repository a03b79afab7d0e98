"""bench/run.py's CPU ceiling of the design's statements: the arithmetic the docs quote."""

import json

import pytest

from bench import run


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


def test_the_results_table_states_the_ceiling():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result["scenarios"]["throughput"]["statements_ceiling"] = {
        "bare_request_cpu_us": 180.0,
        "postgres_cpu_us": 220.0,
        "per_second": 5_000.0,
        "over_bare_loop": 0.5,
    }
    result["cpu_count"] = 2

    text = run.markdown(result)

    assert "CPU ceiling of these statements: **0.50** of the bare loop (5,000/s)" in text
    assert "(180 µs: its client and the receiver)" in text
    assert "the lesser of the service's run and the floor's (220 µs); 2 cores busy" in text
