"""Every long-running command says it is alive on a fixed period, busy or idle: its
heartbeat (a LoopRun row, or a backfill's own run row) is never older than a few periods
while the process runs, so ``webhooks_loop_heartbeat_age_seconds`` and
``delivery_status`` tell a running loop from a stopped one. The commands run as real
processes with a short period (``LOOP_HEARTBEAT_SECONDS``)."""

import io
import time

import pytest
from django.core.management import call_command, get_commands
from django.utils import timezone

from deliveries.jobs.models import LoopRun
from deliveries.models import Delivery
from ingest.models import BackfillRun
from ingest.poll_sources import poll_source_create
from ingest.sources import source_create
from tests.conftest import queue_for_slow_endpoint, scrape, subprocess_env
from tests.ingest.fake_provider import FakeProvider, StaticRecords

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.sqlite]

PERIOD = 0.5
# A beat may be late on a busy 2-core machine; three periods is still far from "stopped"
# (six periods, deliveries.selectors.loop_stale_after).
BOUND = 3 * PERIOD
TOKEN = "Bearer test-token"

# Every command of the service's apps, by how long it runs. A long-running one beats a
# LoopRun of its kind (the poll loop only without --once); the backfill, long but finite,
# beats its own BackfillRun. A new command must be put in one of these.
LONG_RUNNING = {
    "run_scheduler": ("scheduler", ()),
    "run_relay": ("relay", ()),
    "run_workers": ("workers", ()),
    "run_jobs": ("jobs", ()),
    "poll": ("poll", ("crm", "--interval", "3600")),
    "run_smtp": ("smtp", ("--source", "mail", "--port", "0")),
}
BEATS_ITS_OWN_RUN = {"backfill"}
FINITE = {
    "check_alerts",
    "create_source",
    "create_tenant",
    "delivery_status",
    "install_schedules",
    "prune",
    "replay",
    "rotate_encryption_keys",
    "seed_demo",
}


@pytest.fixture
def provider():
    p = FakeProvider(StaticRecords(50, per_ts=1)).start()
    yield p
    p.stop()


def env() -> dict[str, str]:
    return subprocess_env(LOOP_HEARTBEAT_SECONDS=str(PERIOD), LOG_LEVEL="WARNING")


def until(condition, *, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_every_command_is_classified_by_how_it_beats():
    ours = {name for name, app in get_commands().items() if app in {"deliveries", "ingest"}}
    assert ours == set(LONG_RUNNING) | BEATS_ITS_OWN_RUN | FINITE


def test_every_long_running_command_beats_on_its_period_while_idle(tenant, provider, commands):
    poll_source_create(
        slug="crm", config=provider.config(page_size=10), auth_secret=TOKEN, schedule=False
    )
    source_create(slug="mail", scheme="smtp", secrets=[], options={"addresses": ["a@example.com"]})
    started = {kind: commands(name, *a, env=env()) for name, (kind, a) in LONG_RUNNING.items()}
    until(
        lambda: LoopRun.objects.filter(kind__in=started).count() == len(started),
        what="every loop records its run",
    )
    ages = {kind: [] for kind in started}
    sampled_until = time.monotonic() + 8 * PERIOD
    while time.monotonic() < sampled_until:
        now = timezone.now()
        for run in LoopRun.objects.filter(kind__in=started):
            ages[run.kind].append((now - run.heartbeat_at).total_seconds())
        time.sleep(PERIOD / 4)

    assert {kind: max(a) for kind, a in ages.items() if max(a) >= BOUND} == {}
    for command in started.values():
        assert command.stop() == 0, command.output()[-2000:]
    assert not LoopRun.objects.filter(finished_at__isnull=True).exists()
    runs = {r.kind: r for r in LoopRun.objects.all()}
    assert runs["poll"].counts["polled"] == 1 and runs["poll"].counts["stored"] == 50


def test_workers_beat_while_they_drain_and_delivery_status_sees_them_running(
    tenant, receiver, commands, settings
):
    settings.LOOP_HEARTBEAT_SECONDS = PERIOD  # delivery_status's "stopped" is six of them
    # 60 deliveries at 4 requests of 0.5 s at a time: a drain of about 8 s, during which
    # every lane is busy sending or waiting for a request slot.
    queue_for_slow_endpoint(tenant, receiver, deliveries=60, seconds=0.5)
    workers = commands(
        "run_workers", "--concurrency", "4", "--lanes", "1", "--batch-size", "2", env=env()
    )
    until(lambda: LoopRun.objects.filter(kind="workers").exists(), what="workers start")
    began = time.monotonic()
    ages, said = [], set()
    while Delivery.objects.filter(state="succeeded").count() < 60:
        assert time.monotonic() - began < 60, "the drain did not finish"
        age = scrape().get(("webhooks_loop_heartbeat_age_seconds", (("kind", "workers"),)))
        ages.append(age)
        waiting = Delivery.objects.filter(state="enqueued").first()
        if waiting is not None:
            out = io.StringIO()
            call_command("delivery_status", str(waiting.id), stdout=out)
            said.add(out.getvalue().splitlines()[0])
        time.sleep(PERIOD / 2)
    drained = time.monotonic() - began
    workers.stop()

    print(f"drain {drained:.1f} s, {len(ages)} scrapes, heartbeat age max {max(ages):.2f} s")
    assert drained > 6 * PERIOD  # long enough for a silent worker to look stopped
    assert None not in ages and max(ages) < BOUND
    # (One may be leased between the query and the command: "Leased by a worker ...".)
    assert any("a worker will take it" in s for s in said), said
    assert not any("no worker is running" in s for s in said), said


def test_a_backfill_beats_while_its_rate_limit_waits(provider, commands):
    poll_source_create(
        slug="crm", config=provider.config(page_size=10), auth_secret=TOKEN, schedule=False
    )
    # One request every 5 s: after the first page the run waits for its rate limit.
    window = ("--since", "2024-01-01", "--until", "2024-02-01T00:00:00Z", "--rate", "12/m")
    commands("backfill", "crm", *window, "--page-size", "10", env=env())
    until(lambda: BackfillRun.objects.filter(pages=1).exists(), what="the first page is stored")
    ages = []
    sampled_until = time.monotonic() + 6 * PERIOD
    while time.monotonic() < sampled_until:
        run = BackfillRun.objects.get()
        if run.pages == 1:  # waiting for its second request
            ages.append((timezone.now() - run.heartbeat_at).total_seconds())
        time.sleep(PERIOD / 4)

    assert len(ages) >= 10 and max(ages) < BOUND
