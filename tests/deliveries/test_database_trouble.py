"""Database trouble (tests/chaos/dbtrouble.py): every long-running process, run_scheduler,
run_relay, run_workers (outbound deliveries and inbound processing), run_jobs (background
jobs) and the gunicorn web server, survives pg_terminate_backend of its own connections
and a restart of the server (fast, then immediate) without being restarted, and nothing
is lost: every outbound event published around the trouble is delivered, every inbound
event applied once and every background job done."""

import pytest

from tests.deliveries.test_soak import run_harness

pytestmark = pytest.mark.slow


def test_every_long_running_command_survives_dropped_connections_and_a_restarted_server():
    result, report = run_harness("tests.chaos.dbtrouble", timeout=400)
    shown = result.stdout[-4000:] + result.stderr[-2000:]
    assert report, shown
    assert [p["phase"] for p in report["phases"] if not p["settled"]] == [], shown
    assert all(p["effect"] for p in report["phases"][1:]), shown  # each trouble hit something
    assert report["alive"] == dict.fromkeys(report["alive"], True), shown
    assert report["never_restarted"] and not report["unexpected_exits"], shown
    assert set(report["stop_codes"].values()) == {0}, shown
    assert report["deliveries"] == report["delivered"] == report["received"], shown
    assert report["inbound_applied_once"] == report["inbound_sent"], shown
    assert report["inbound_applied_twice"] == 0, shown
    assert report["jobs"] == report["jobs_done"] == report["deliveries"], shown
    assert result.returncode == 0 and report["ok"], shown
