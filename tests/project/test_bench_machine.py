"""bench/run.py's record of the machine a run was made on: its Python speed."""

import json

from bench import run


def test_the_python_speed_is_a_timing_of_the_loop():
    # Twenty times the additions take longer: the figure is a measurement, not a constant.
    small = run.python_loop_seconds(100_000, rounds=1)
    large = run.python_loop_seconds(2_000_000, rounds=1)

    assert 0 < small < large


def test_the_results_header_states_the_python_speed_when_recorded():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result["python_loop_seconds"] = 0.537

    header = run.markdown(result).splitlines()[2]

    assert "CPUs (" in header
    assert "Python's 10-million-addition loop 0.54 s, load average at start" in header


def test_results_made_before_the_speed_was_recorded_still_render():
    result = json.loads((run.RESULTS / "results.json").read_text())
    result.pop("python_loop_seconds", None)

    header = run.markdown(result).splitlines()[2]

    assert "addition loop" not in header
    assert "), load average at start" in header
