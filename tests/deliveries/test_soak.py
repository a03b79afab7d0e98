"""The short drain-and-count soak (tests/chaos/soak.py, docs/reliability.md) inside the
suite: the real scheduler, relay, workers, run_jobs and gunicorn on a private PostgreSQL
cluster, killed with kill -9 and at the named crash points, the cluster restarted once
and every connection terminated once, a receiver that fails, throttles, hangs, drops
connections and answers 410, background jobs that succeed, retry, fail and share entity
locks; then a full drain, and the ledger must balance.

The seed is random and printed (SOAK_SEED=n to replay one)."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run_harness(
    module: str, *args: str, timeout: float
) -> tuple[subprocess.CompletedProcess, dict]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"{module.rsplit('.', 1)[-1]}-{os.getpid()}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    return result, report


def ledger_lines(stdout: str) -> str:
    return stdout[stdout.find("== soak ledger") :] if "== soak ledger" in stdout else stdout[-3000:]


def test_the_short_soak_drains_and_its_ledger_balances():
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
    result, report = run_harness(
        "tests.chaos.soak", "--short", "--events", "800", "--seed", str(seed), timeout=300
    )
    shown = ledger_lines(result.stdout) + result.stderr[-2000:]
    assert report, shown
    out, inbound, chaos = report["outbound"], report["inbound"], report["chaos"]
    jobs = report["jobs"]
    print(ledger_lines(result.stdout))

    # The chaos really happened.
    assert sum(chaos["kills"].values()) >= 5, shown
    assert set(chaos["kills"]) == {"jobs", "relay", "scheduler", "worker"}, shown
    assert chaos["pg_restarts"] == 1 and chaos["terminated"] > 0, shown
    assert out["cut_off"] > 0 and out["receiver_actions"].get("drop", 0) > 0, shown
    # The ledger: everything published is accounted for, nothing lost or unexplained.
    assert chaos["drained"], shown
    assert out["events"] == 800 and out["in_flight"] == 0, shown
    assert out["deliveries"] + out["no_subscriber"] == out["events"] and out["balanced"], shown
    assert out["lost"] == 0 and out["unexpected"] == 0, shown
    assert out["bad_signatures"] == 0 and out["signatures_verified"] == out["copies"], shown
    assert not chaos["unexpected_exits"], shown
    assert set(chaos["stop_codes"].values()) == {0}, shown
    # Inbound: one application per event, whatever the copies and their order.
    assert inbound["applied_once"] == inbound["events"] and inbound["applied_twice"] == 0, shown
    assert inbound["entities_at_newest"] == inbound["entities"], shown
    # Jobs: each ends done, or dead by its design with its reason; none left pending or
    # running; no two runs under one entity lock at the same time.
    assert jobs["enqueued"] == 200 and jobs["lost"] == 0 and jobs["unexpected"] == 0, shown
    assert jobs["done"] + jobs["dead_by_policy"] == jobs["enqueued"], shown
    assert jobs["dead_by_policy"] == jobs["designed_to_die"] > 0, shown
    assert jobs["states"] == {"done": jobs["done"], "dead": jobs["dead_by_policy"]}, shown
    assert jobs["lock_keys"] == 8 and jobs["locked_runs"] > 50 and jobs["overlaps"] == 0, shown
    assert jobs["retry_after_checked"] > 0 and jobs["retry_after_early"] == 0, shown
    assert jobs["runs_recorded"].get("error", 0) > 0, shown  # flaky and exhausted runs
    assert not jobs["problems"], shown
    assert result.returncode == 0 and report["ok"], shown
