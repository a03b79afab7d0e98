"""deliveries/core/ratelimit.py: concurrent hits on one counter, from real threads each with its
own database connection, are each counted once, in the database cache and in Redis."""

import threading
import uuid

import pytest
from django.core.cache import caches

from deliveries.core import ratelimit
from tests.conftest import in_thread

pytestmark = pytest.mark.django_db(transaction=True)

THREADS, HITS = 8, 25
REDIS_TEST_DB = "redis://127.0.0.1:6379/15"


def _hammer(key: str) -> list[int]:
    """Every count ``hit`` returned, THREADS threads hitting ``key`` at once."""
    counts: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def hits():
        start.wait()
        for _ in range(HITS):
            counts.append(ratelimit.hit(key, window=3600)[0])

    for thread in [in_thread(hits, errors) for _ in range(THREADS)]:
        thread.join(60)
    assert not errors, errors
    return counts


def test_concurrent_hits_in_the_database_cache_are_each_counted_once():
    # Django's database cache increments by reading and writing back: without the lock,
    # two threads reading the same count write the same next one.
    assert type(caches["default"]).__name__ == "DatabaseCache"
    counts = _hammer(f"test-{uuid.uuid4()}")
    assert sorted(counts) == list(range(1, THREADS * HITS + 1))


def test_concurrent_hits_in_redis_are_each_counted_once(settings):
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_TEST_DB,
        }
    }
    caches["default"].clear()
    counts = _hammer(f"test-{uuid.uuid4()}")
    assert sorted(counts) == list(range(1, THREADS * HITS + 1))


def test_a_hit_reports_the_time_left_in_its_window():
    count, left = ratelimit.hit(f"test-{uuid.uuid4()}", window=60)
    assert count == 1
    assert 0 < left <= 60
