"""The retry policy and the classification table: pure functions, no database."""

import dataclasses
import itertools
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deliveries.core.retry import MIN_STEP, RetryPolicy, parse_retry_after
from deliveries.models import Outcome
from deliveries.policy import classify

SCHEDULE = (5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.SUCCESS),
        (204, Outcome.SUCCESS),
        (299, Outcome.SUCCESS),
        (410, Outcome.ENDPOINT_GONE),
        (408, Outcome.RETRY),
        (425, Outcome.RETRY),
        (429, Outcome.RETRY),
        (500, Outcome.RETRY),
        (502, Outcome.RETRY),
        (503, Outcome.RETRY),
        (599, Outcome.RETRY),
        (301, Outcome.PERMANENT),
        (302, Outcome.PERMANENT),
        (307, Outcome.PERMANENT),
        (400, Outcome.PERMANENT),
        (401, Outcome.PERMANENT),
        (404, Outcome.PERMANENT),
        (422, Outcome.PERMANENT),
        (100, Outcome.PERMANENT),
    ],
)
def test_classification_of_status_codes(status, outcome):
    assert classify(status=status).outcome == outcome


def test_client_errors_retry_when_the_endpoint_opts_in():
    assert classify(status=404, retry_client_errors=True).outcome == Outcome.RETRY
    # 410 still means "stop", and 3xx is still a failure.
    assert classify(status=410, retry_client_errors=True).outcome == Outcome.ENDPOINT_GONE
    assert classify(status=302, retry_client_errors=True).outcome == Outcome.PERMANENT


@pytest.mark.parametrize("kind", ["dns", "connect", "tls", "protocol", "timeout"])
def test_transport_errors_retry(kind):
    assert classify(status=None, error_kind=kind).outcome == Outcome.RETRY


def test_a_timeout_after_sending_is_ambiguous():
    c = classify(status=None, error_kind="timeout", ambiguous=True)
    assert c.outcome == Outcome.RETRY and c.ambiguous


@pytest.mark.parametrize("kind", ["blocked", "invalid_url"])
def test_a_refused_destination_is_not_retried(kind):
    assert classify(status=None, error_kind=kind).outcome == Outcome.BLOCKED


def test_an_unknown_error_kind_is_a_bug_not_a_silent_retry():
    with pytest.raises(ValueError, match="error kind"):
        classify(status=None, error_kind="")


def test_the_schedule_gives_one_more_attempt_than_steps_then_dead():
    policy = RetryPolicy(schedule=(1, 2, 3), jitter=0)
    assert [policy.next_delay(n) for n in (1, 2, 3, 4)] == [1, 2, 3, None]
    assert policy.max_attempts == 4


def default_policy_without_jitter() -> RetryPolicy:
    """The policy the settings give by default (DELIVERY_RETRY_SCHEDULE), jitter off."""
    return dataclasses.replace(RetryPolicy.from_settings(), jitter=0)


def test_the_default_schedule_spans_about_three_days():
    policy = default_policy_without_jitter()
    steps = len(policy.schedule)
    total = sum(policy.next_delay(n) for n in range(1, steps + 1))
    assert timedelta(days=2.5) < timedelta(seconds=total) < timedelta(days=3.5)


def test_retry_after_lengthens_but_never_shortens_and_is_clamped():
    policy = RetryPolicy(schedule=(5, 300), jitter=0, retry_after_max=3600)
    assert policy.next_delay(1, retry_after=7) == 7
    assert policy.next_delay(2, retry_after=7) == 300
    assert policy.next_delay(1, retry_after=10**9) == 3600
    # Spent schedule: dead even if the receiver asks to be called back.
    assert policy.next_delay(3, retry_after=7) is None


@given(
    schedule=st.lists(st.just(0.0) | st.floats(MIN_STEP, 10**6), min_size=1, max_size=12),
    jitter=st.floats(0, 0.99),
    seed=st.integers(),
    retry_after=st.none() | st.floats(0, 10**7),
)
def test_delays_stay_within_jitter_and_never_exceed_the_bounds(schedule, jitter, seed, retry_after):
    policy = RetryPolicy(schedule=tuple(schedule), jitter=jitter, retry_after_max=21600)
    rng = random.Random(seed)
    for n, base in enumerate(schedule, start=1):
        delay = policy.next_delay(n, retry_after=retry_after, rng=rng)
        low, high = base * (1 - jitter), base * (1 + jitter)
        if retry_after is not None:
            low = max(low, min(retry_after, 21600))
            high = max(high, min(retry_after, 21600))
        assert low - 1e-6 <= delay <= high + 1e-6
    assert policy.next_delay(len(schedule) + 1, rng=rng) is None


def test_the_default_schedule_never_shortens():
    policy = default_policy_without_jitter()
    delays = [policy.next_delay(n) for n in range(1, len(policy.schedule) + 1)]
    assert len(delays) >= 2
    assert delays == sorted(delays)


@given(seed=st.integers(), retry_after=st.none() | st.floats(0, 10**6))
def test_each_retry_is_scheduled_after_the_one_before(seed, retry_after):
    # Jitter may make one step shorter than the step before it (20 h ± 20 % overlaps
    # 24 h ± 20 %), but each retry still happens after the previous one: the wait is
    # counted from the failed attempt, and every wait is positive.
    policy = RetryPolicy(schedule=SCHEDULE, jitter=0.2)
    rng = random.Random(seed)
    at, times = 0.0, []
    for n in range(1, len(SCHEDULE) + 1):
        at += policy.next_delay(n, retry_after=retry_after, rng=rng)
        times.append(at)
    assert all(b > a for a, b in itertools.pairwise(times))


def test_jitter_spreads_retries():
    policy = RetryPolicy(schedule=(100,), jitter=0.2)
    rng = random.Random(1)
    delays = {round(policy.next_delay(1, rng=rng), 3) for _ in range(50)}
    assert len(delays) > 40
    assert all(80 <= d <= 120 for d in delays)


def test_invalid_policies_are_refused():
    with pytest.raises(ValueError):
        RetryPolicy(schedule=(-1,))
    with pytest.raises(ValueError):
        RetryPolicy(schedule=(1,), jitter=1.5)
    with pytest.raises(ValueError):
        RetryPolicy(schedule=(1,)).next_delay(0)


def test_retry_after_reads_seconds_and_http_dates():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert parse_retry_after("7", now=now) == 7
    assert (
        parse_retry_after(format_datetime(now + timedelta(seconds=90), usegmt=True), now=now) == 90
    )
    assert (
        parse_retry_after(format_datetime(now - timedelta(seconds=90), usegmt=True), now=now) == 0
    )
    assert parse_retry_after("soon", now=now) is None
    assert parse_retry_after("", now=now) is None
    assert parse_retry_after(None, now=now) is None
