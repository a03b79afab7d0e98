"""Throttles across processes: gunicorn with three worker processes of one thread each,
so concurrent requests are necessarily served by different processes, and every limit
must hold for all of them together (the counters live in the shared cache)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from deliveries.services import tenant_create
from ingest.sources import source_create
from tests.conftest import gunicorn_server, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORKERS = 3
REQUESTS = 60


def _burst(call) -> tuple[list[requests.Response], float, float]:
    """REQUESTS calls of ``call``, 12 at a time; (answers, start, end) by the clock."""
    started = time.time()
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: call(), range(REQUESTS)))
    return answers, started, time.time()


def _windows(started: float, ended: float, window: float) -> int:
    """Fixed windows of ``window`` seconds a burst touched: across an edge, up to twice
    the limit is allowed in less than a window."""
    return int(ended // window) - int(started // window) + 1


def test_the_api_rate_holds_across_worker_processes():
    _, api_key = tenant_create(name="throttled")
    env = subprocess_env(API_THROTTLE_RATE="10/h", GUNICORN_THREADS="1", LOG_LEVEL="WARNING")
    with gunicorn_server(env, workers=WORKERS) as (base, _):
        answers, started, ended = _burst(
            lambda: requests.get(
                f"{base}/api/v1/events/", headers={"Authorization": f"Bearer {api_key}"}, timeout=60
            )
        )
    statuses = sorted(r.status_code for r in answers)
    allowed = 10 * _windows(started, ended, 3600)
    assert statuses.count(200) == min(allowed, REQUESTS), statuses
    assert set(statuses) == {200, 429}, statuses
    refused = [r for r in answers if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "throttled" for r in refused)
    assert all(int(r.headers["Retry-After"]) > 0 for r in refused)


def test_a_sources_rate_limit_holds_across_worker_processes():
    source_create(slug="limited", scheme="stripe", secrets=["whsec_limited"], rate_limit=3)
    env = subprocess_env(GUNICORN_THREADS="1", LOG_LEVEL="WARNING")
    body = b'{"id": "evt_1", "object": "event", "type": "x"}'
    headers = {"content-type": "application/json", "stripe-signature": "t=1,v1=00"}
    with gunicorn_server(env, workers=WORKERS) as (base, _):
        answers, started, ended = _burst(
            lambda: requests.post(f"{base}/ingest/limited/", data=body, headers=headers, timeout=60)
        )
    statuses = [r.status_code for r in answers]
    # Past the limit: 429; under it the unsigned request is refused for its signature.
    assert set(statuses) <= {401, 429}, statuses
    assert 1 <= statuses.count(401) <= 3 * _windows(started, ended, 1.0), (
        statuses.count(401),
        ended - started,
    )
