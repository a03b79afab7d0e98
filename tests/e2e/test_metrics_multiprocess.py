"""/metrics under gunicorn with two workers and PROMETHEUS_MULTIPROC_DIR: counters from
every web worker and from a separate scheduler process reach one scrape."""

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.utils import timezone
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from bench.outbound import child_pids
from deliveries import services, state
from deliveries.models import Delivery
from deliveries.scheduler import scheduler_tick
from ingest.sources import source_create
from tests.conftest import gunicorn_server, manage, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "multiproc-metrics-token"


def _get(url: str, **headers) -> tuple[int, bytes]:
    response = requests.get(url, headers=headers, timeout=60)
    return response.status_code, response.content


def _post(url: str, body: bytes) -> int:
    headers = {"content-type": "application/json", "stripe-signature": "t=1,v1=00"}
    return requests.post(url, data=body, headers=headers, timeout=60).status_code


def _samples(text: bytes) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def _refused_in_file(directory: Path, pid: int) -> float:
    """The inbound refusals counted by process ``pid``, read from its own counter file."""
    path = directory / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
        _, name, labels, _ = json.loads(key)
        if name == "webhooks_inbound_refused_total" and labels.get("source") == "mp":
            total += value
    return total


def test_counters_of_every_process_reach_one_scrape(tmp_path, tenant, make_endpoint):
    source_create(slug="mp", scheme="stripe", secrets=["whsec_mp_secret"])
    make_endpoint("http://127.0.0.1:9/x")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    delivery = Delivery.objects.get()
    now = timezone.now()
    state.lease([(delivery.id, 1)], now=now, lease_seconds=60)
    Delivery.objects.update(lease_until=now - timedelta(seconds=1))

    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = subprocess_env(
        PROMETHEUS_MULTIPROC_DIR=str(multiproc),
        METRICS_TOKEN=TOKEN,
        METRICS_ALLOW_IPS="",
    )
    # The scheduler, another process, expires the lease: its counter lands in the dir.
    done = manage("run_scheduler", "--once", env=env)
    assert done.returncode == 0, done.stderr
    assert "lease_expired=1" in done.stdout

    with gunicorn_server(env, workers=2) as (base, server):
        workers = child_pids(server.pid)
        assert len(workers) == 2, workers
        # Refused requests, 8 at a time, until each of the two web workers has counted
        # some in its own file (which worker takes a request is the kernel's choice).
        body = json.dumps({"id": "evt_1", "object": "event", "type": "x"}).encode()
        statuses: list[int] = []
        with ThreadPoolExecutor(8) as pool:
            while len(statuses) < 400:
                batch = pool.map(lambda _: _post(f"{base}/ingest/mp/", body), range(40))
                statuses += list(batch)
                if all(_refused_in_file(multiproc, pid) for pid in workers):
                    break
        assert statuses == [401] * len(statuses)
        by_worker = {pid: _refused_in_file(multiproc, pid) for pid in workers}
        assert all(by_worker.values()), by_worker
        assert sum(by_worker.values()) == len(statuses), by_worker

        assert _get(f"{base}/metrics")[0] == 403  # no token, no allowed address
        status, text = _get(f"{base}/metrics", Authorization=f"Bearer {TOKEN}")
        assert status == 200

    samples = _samples(text)
    refused = {"source": "mp", "reason": "malformed_signature"}
    key = ("webhooks_inbound_refused_total", tuple(sorted(refused.items())))
    # One scrape adds up both workers' files.
    found = samples.get(key)
    assert found == len(statuses), [k for k in samples if k[0].startswith("webhooks_inbound")]
    assert samples[("webhooks_lease_expiries_total", (("job", "delivery"),))] == 1
    # The database gauges come with the same scrape.
    assert samples[("webhooks_deliveries", (("state", "pending"),))] == 1
    # Each process that counted kept its own file: the scheduler and the web workers.
    assert len(list(multiproc.glob("counter_*.db"))) >= 3
