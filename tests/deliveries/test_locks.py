import threading

import pytest
from django.db import connection
from django.utils import timezone

from deliveries.jobs.locks import entity_lock_acquire, entity_lock_release

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def test_one_holder_at_a_time_until_release_or_expiry():
    now = timezone.now()
    assert entity_lock_acquire(key="customer:1", owner="a", ttl=30, now=now)
    assert not entity_lock_acquire(key="customer:1", owner="b", ttl=30, now=now)
    assert entity_lock_acquire(key="customer:1", owner="a", ttl=30, now=now)  # renew
    assert not entity_lock_release(key="customer:1", owner="b")
    assert entity_lock_release(key="customer:1", owner="a")
    assert entity_lock_acquire(key="customer:1", owner="b", ttl=30, now=now)

    later = now + timezone.timedelta(seconds=31)
    assert entity_lock_acquire(key="customer:1", owner="c", ttl=30, now=later)
    assert not entity_lock_release(key="customer:1", owner="b")


def test_concurrent_acquirers_get_one_winner():
    barrier = threading.Barrier(8)
    wins, answered = [], []

    def contend(i):
        try:
            barrier.wait()
            if entity_lock_acquire(key="order:9", owner=f"w{i}", ttl=30):
                wins.append(i)
            answered.append(i)  # a thread that raised never gets here
        finally:
            connection.close()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answered) == list(range(8))
    assert len(wins) == 1
