"""End to end on the embedded SQLite database that `make run` uses.

The rest of the suite runs on PostgreSQL. This test leaves the test database alone: every
step is a real ``manage.py`` process on a SQLite file in a temporary directory, the way
`make run` runs them, and the scheduler, the relay and two workers processes run at the
same time as a publisher, to show that the WAL, busy-timeout and IMMEDIATE-transaction
settings let several processes share the file without "database is locked" errors.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from standardwebhooks import Webhook

from tests.receiver import Receiver, fail_first

ROOT = Path(__file__).resolve().parents[2]
MANAGE = [sys.executable, str(ROOT / "manage.py")]
FIRST_BATCH = 5
EVENTS = 20
DEADLINE_SECONDS = 60
STOP_SECONDS = 20

pytestmark = pytest.mark.slow

CREATE_ENDPOINT = """
import json
from deliveries.models import Tenant
from deliveries.services import endpoint_create
endpoint, secret = endpoint_create(tenant=Tenant.objects.get(name="smoke"), url={url!r})
print(json.dumps({{"endpoint": str(endpoint.id), "secret": secret}}))
"""

# One event per transaction, with pauses, so the publisher's writes interleave with the
# loops' writes instead of landing in one burst.
PUBLISH = """
import time
from deliveries.models import Tenant
from deliveries.services import publish_event
tenant = Tenant.objects.get(name="smoke")
for n in range({start}, {stop}):
    publish_event(tenant=tenant, event_type="smoke.test", payload={{"type": "smoke.test", "n": n}})
    time.sleep({pause})
"""

REPORT = """
import json
from collections import Counter
from dataclasses import dataclass
from deliveries.models import Delivery, DeliveryListing
print(json.dumps({
    "states": Counter(Delivery.objects.values_list("state", flat=True)),
    "ids": [str(i) for i in Delivery.objects.values_list("id", flat=True)],
    "owners": sorted(map(list, Delivery.objects.values_list("id", "tenant_id", "endpoint_id"))),
    "listed": sorted(map(list, DeliveryListing.objects.values_list(
        "delivery_id", "tenant_id", "endpoint_id"))),
}, default=str))
"""


@pytest.fixture
def sqlite_env(tmp_path):
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    env.update(
        SQLITE_PATH=str(tmp_path / "smoke.sqlite3"),
        EGRESS_ALLOW_NETWORKS="127.0.0.0/8",
        # Retries half a second apart, so the retry path runs within the test.
        DELIVERY_RETRY_SCHEDULE="0.5,0.5,0.5",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def manage(env, *args: str) -> str:
    """Run a command to completion; its stdout. Fails the test on a non-zero exit or on a
    locking error, which the loops would otherwise log and retry past."""
    result = subprocess.run(
        [*MANAGE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"manage.py {args[0]} exited {result.returncode}:\n{output}"
    assert "database is locked" not in output, output
    return result.stdout


def shell(env, code: str) -> str:
    return manage(env, "shell", "--no-imports", "-c", code)


def last_json(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])


@dataclass
class Running:
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[str]


def start(env, tmp_path: Path, name: str, *args: str) -> Running:
    # Output goes to a file, not a pipe, so a chatty process can never block on it.
    log_path = tmp_path / f"{name}.log"
    log_file = log_path.open("w")
    proc = subprocess.Popen(
        [*MANAGE, *args], cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
    )
    return Running(proc, log_path, log_file)


def stop(running: Running) -> tuple[int, str]:
    """SIGTERM, then the exit code and everything the process wrote."""
    proc = running.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    running.log_file.close()
    return code, running.log_path.read_text()


def test_several_processes_share_the_sqlite_file_and_deliver_every_event(
    sqlite_env, receiver, tmp_path
):
    url = receiver.url("/smoke")
    manage(sqlite_env, "migrate", "--noinput")
    api_key = manage(sqlite_env, "create_tenant", "smoke").strip().splitlines()[-1]
    assert api_key.startswith("whk_")
    secret = last_json(shell(sqlite_env, CREATE_ENDPOINT.format(url=url)))["secret"]

    # The one-shot forms, one after another (cron, or a batch job).
    shell(sqlite_env, PUBLISH.format(start=0, stop=FIRST_BATCH, pause=0))
    manage(sqlite_env, "run_scheduler", "--once")
    manage(sqlite_env, "run_relay", "--until-idle")
    manage(sqlite_env, "run_workers", "--until-idle")
    assert len({r.webhook_id for r in receiver.requests_to("/smoke")}) == FIRST_BATCH

    # The long-running loops and a publisher, all at once, and every new delivery
    # failing once, so that retries (pending again, admitted again) join the writes.
    receiver.behaviours["/smoke"] = fail_first(1, status=503)
    procs = {
        name: start(sqlite_env, tmp_path, name, *args)
        for name, args in {
            "scheduler": ["run_scheduler"],
            "relay": ["run_relay"],
            "workers-1": ["run_workers", "--lanes", "2"],
            "workers-2": ["run_workers", "--lanes", "2"],
            "publisher": [
                "shell",
                "--no-imports",
                "-c",
                PUBLISH.format(start=FIRST_BATCH, stop=EVENTS, pause=0.1),
            ],
        }.items()
    }
    try:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while True:
            copies = Counter(r.webhook_id for r in receiver.requests_to("/smoke"))
            # Each of the later deliveries is answered 503, then 200.
            if len(copies) == EVENTS and sum(n >= 2 for n in copies.values()) >= (
                EVENTS - FIRST_BATCH
            ):
                break
            exited = {n: r.proc.poll() for n, r in procs.items() if r.proc.poll() not in (None, 0)}
            assert not exited, f"exited early: {exited}"
            assert time.monotonic() < deadline, f"receiver saw {dict(copies)} by the deadline"
            time.sleep(0.1)
    finally:
        # SIGTERM: each loop finishes (and records) the work in hand, then exits 0.
        stopped = {name: stop(proc) for name, proc in procs.items()}
    for name, (code, output) in stopped.items():
        assert code == 0, f"{name} exited {code}:\n{output}"
        assert "database is locked" not in output, f"{name}:\n{output}"

    report = last_json(shell(sqlite_env, REPORT))
    assert report["states"] == {"succeeded": EVENTS}
    # The ORM's publish path writes each delivery's listing row too.
    assert report["listed"] == report["owners"] and len(report["listed"]) == EVENTS
    received = receiver.requests_to("/smoke")
    assert {r.webhook_id for r in received} == set(report["ids"])
    verifier = Webhook(secret)
    for r in received:
        assert json.loads(r.body)["type"] == "smoke.test"
        verifier.verify(r.body, r.headers)  # raises on a bad signature
