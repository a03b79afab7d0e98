"""The outbound benchmarks' bare loop: in every repeat it runs at 64 and at 256 requests in
flight, and the faster run is the baseline of every outbound ratio of that repeat
(``bench/outbound.py``'s ``best_bare``, used by it and by ``bench/run.py``)."""

import json

import pytest

from bench import outbound, run

N = 10_000


def _bare(concurrency: int, per_second: float | None, client_cpu: float = 1.0) -> dict:
    return {
        "concurrency": concurrency,
        "per_second": per_second,
        "cpu_seconds": {"client": client_cpu, "receiver": 1.0},
    }


def test_the_baselines_counts_are_64_and_256():
    assert outbound.BARE_CONCURRENCIES == (64, 256)


@pytest.mark.parametrize(
    "rates, faster",
    [
        ((5_000.0, 4_000.0), 64),
        ((4_000.0, 6_000.0), 256),
        ((None, 4_000.0), 256),  # a run without a rate is never the baseline
        ((5_000.0, 5_000.0), 64),  # a tie: the first count
    ],
)
def test_the_bare_loop_of_a_repeat_is_its_faster_run(rates, faster):
    runs = [_bare(c, r, client_cpu=c / 100) for c, r in zip((64, 256), rates, strict=True)]

    best = outbound.best_bare(runs)

    assert best["concurrency"] == faster
    # The picked run whole, its CPU included: the CPU per request comes from it too.
    assert best["cpu_seconds"]["client"] == faster / 100
    assert best["rates_by_concurrency"] == {"64": rates[0], "256": rates[1]}


def test_there_is_no_bare_loop_without_a_run():
    with pytest.raises(ValueError):
        outbound.best_bare([])


def _systems() -> dict[str, list[dict]]:
    """Two repeats: 64 in flight is faster in the first, 256 in the second."""
    service = {"workers0": 1.9, "scheduler": 0.1, "receiver": 1.0, "postgres_all": 1.0}
    return {
        run.bare_loop_at(64): [_bare(64, 5_000.0), _bare(64, 4_000.0, client_cpu=1.2)],
        run.bare_loop_at(256): [_bare(256, 4_000.0, client_cpu=1.5), _bare(256, 6_000.0, 0.8)],
        run.BASELINE_SIGNED: [
            {"per_second": 4_500.0, "cpu_seconds": {"client": 1.5, "receiver": 1.0}},
            {"per_second": 4_800.0, "cpu_seconds": {"client": 1.5, "receiver": 1.0}},
        ],
        # 400 µs of CPU a delivery in every process, 100 of them PostgreSQL's.
        "service": [
            {"per_second": 2_500.0, "cpu_seconds": service},
            {"per_second": 3_600.0, "cpu_seconds": service},
        ],
        run.SERVICE_REDIS: [{"per_second": 2_000.0}, {"per_second": 3_000.0}],
        run.SERVICE_SPREAD: [{"per_second": 2_250.0}, {"per_second": 3_300.0}],
        run.BASELINE_FLOOR: [
            {"per_second": 3_000.0, "cpu_seconds": {"postgres_all": 2.0}},
            {"per_second": 4_200.0, "cpu_seconds": {"postgres_all": 2.0}},
        ],
        "django-q2 Redis": [{"per_second": 500.0}, {"per_second": 600.0}],
    }


def test_every_outbound_ratio_is_taken_against_the_faster_bare_loop_of_its_repeat():
    summary = run.throughput_summary(_systems(), N, cores=2)

    assert summary["bare_loop"] == {
        "concurrencies": [64, 256],
        "better_by_repeat": [64, 256],
        "median_per_second": {"64": 4_500.0, "256": 5_000.0},
    }
    assert summary["median_per_second"][run.BARE_LOOP] == 5_500.0  # 5,000 and 6,000
    ratios = summary["ratios"]
    # Repeat 1 against 5,000/s (64 in flight), repeat 2 against 6,000/s (256): 0.5 and
    # 0.6. Against 256 alone it would be 0.61, against 64 alone 0.7.
    assert ratios["service_over_bare_loop"] == 0.55
    assert ratios["redis_broker_over_bare_loop"] == 0.45  # 0.4, 0.5
    assert ratios["spread_over_bare_loop"] == 0.5  # 0.45, 0.55
    assert ratios["statements_floor_over_bare_loop"] == 0.65  # 0.6, 0.7
    assert ratios["signed_loop_over_bare_loop"] == 0.85  # 0.9, 0.8
    assert ratios[f"service_over_{run.bare_loop_at(64)}"] == 0.7  # 0.5, 0.9
    assert ratios["service_over_fastest_peer"] == 5.5  # 5, 6
    # The CPU per request is the faster run's: 200 µs (64), then 180 µs (256).
    cpu = summary["cpu_over_bare_loop"]
    assert [c["bare_request_cpu_us"] for c in cpu["runs"]] == [200.0, 180.0]
    assert [c["ratio"] for c in cpu["runs"]] == [2.0, 2.222]
    ceilings = summary["statements_ceiling"]["runs"]
    assert [c["bare_request_cpu_us"] for c in ceilings] == [200.0, 180.0]
    # 2 cores / (200 + 100 µs) = 6,667/s against 5,000/s; / (180 + 100 µs) against 6,000/s.
    assert [c["over_bare_loop"] for c in ceilings] == [1.333, 1.19]
    bounds = summary["design_bound"]["runs"]
    assert [round(b["per_second"] / b["over_bare_loop"], -1) for b in bounds] == [5000, 6000]


def test_the_results_name_the_faster_count_of_each_repeat_and_both_rates():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result["scenarios"]["throughput"].update(run.throughput_summary(_systems(), N, cores=2))

    text = run.markdown(result)

    assert (
        "Bare loop: the faster of 64 and 256 requests in flight in each repeat, the baseline "
        "of every ratio to the bare loop and of the CPU per request in that repeat. The "
        "faster by repeat: 64, 256 in flight; medians 4,500/s at 64, 5,000/s at 256."
    ) in text
    assert f"| {run.bare_loop_at(64)} | 4,500 | 0.70 |" in text
    assert f"| {run.BARE_LOOP} | 5,500 | 0.55 |" in text


def test_results_of_a_loop_at_one_count_render_without_the_line():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result["scenarios"]["throughput"].pop("bare_loop", None)

    text = run.markdown(result)

    assert "Service ÷ bare loop: **" in text
    assert "Bare loop: the faster of" not in text


def test_outbound_names_the_faster_count_of_each_run():
    picked = [
        outbound.best_bare([_bare(64, 5_000.0), _bare(256, 4_000.0)]),
        outbound.best_bare([_bare(64, 4_000.0), _bare(256, 6_000.0)]),
    ]

    assert outbound.bare_loop_line(picked) == (
        "Bare loop: the faster of 64 and 256 requests in flight in each run, the baseline of "
        "that run's ratio. By run: 64 (64: 5,000/s, 256: 4,000/s); "
        "256 (64: 4,000/s, 256: 6,000/s)."
    )
