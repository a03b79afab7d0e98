"""The retry policy under hostile input: whatever a receiver puts in ``Retry-After`` and
whatever an operator puts in the schedule, every wait is finite, inside its jitter band,
bounded by the clamp, and the schedule ends. Pure: no database, no clock.

``tests/deliveries/test_policy.py`` holds the worked examples and the band for a
well-formed ``Retry-After``; these are the properties over arbitrary input.
"""

import itertools
import math
import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from deliveries.core.retry import MIN_STEP, RetryPolicy, parse_retry_after

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
PROPERTY = hypothesis_settings(max_examples=300, deadline=None)

# What a receiver can put in a header: any text, biased towards the shapes a parser meets
# (digits in other scripts, signs, exponents, huge numbers, HTTP dates near the limits).
retry_after_texts = st.one_of(
    st.text(max_size=40),
    # Digits of other scripts: superscripts, Arabic-Indic, NKo, Devanagari, Thai.
    st.text(alphabet="0123456789+-.eE \u00b2\u00b3\u00b9\u0661\u0662\u07c0\u0966\u0e51"),
    st.integers(-(10**30), 10**400).map(str),
    st.sampled_from(
        [
            "Fri, 31 Dec 9999 23:59:59 GMT",
            "Mon, 01 Jan 0001 00:00:00 GMT",
            "Thu, 01 Jan 1970 00:00:00 GMT",
            "Wed, 21 Oct 2015 07:28:00",  # no zone
            "Wed, 32 Oct 2015 07:28:00 GMT",
            "Sun, 06 Nov 1994 08:49:37 +9999",
            "nan",
            "inf",
            "1e400",
            "0x10",
            "\x00",
        ]
    ),
)

# A step is 0 or from MIN_STEP (shorter positive steps are refused, see below).
steps = st.just(0.0) | st.floats(MIN_STEP, 10**6)
schedules = st.lists(steps, min_size=1, max_size=12).map(tuple)


@PROPERTY
@given(value=st.none() | retry_after_texts)
def test_any_retry_after_header_reads_as_none_or_a_non_negative_number(value):
    """A receiver's header can never raise into the worker's recording path."""
    seconds = parse_retry_after(value, now=NOW)

    assert seconds is None or (seconds >= 0 and not math.isnan(seconds))


@pytest.mark.parametrize(
    "value", ["\u00b2", "\u00b9\u00b2", "\u0661\u0662", "\u07c1", "+5", "-5", " 5e2", "5.0"]
)
def test_only_plain_ascii_digits_are_delay_seconds(value):
    # "\u00b2" (superscript two) passes isdigit() and float() raises; Arabic-Indic "12"
    # passes isdigit() and float() reads 12. RFC 9110 delay-seconds is ASCII 1*DIGIT.
    assert parse_retry_after(value, now=NOW) is None


@PROPERTY
@given(
    schedule=schedules,
    jitter=st.floats(0, 0.99),
    clamp=st.floats(0, 10**7),
    seed=st.integers(),
    header=st.none() | retry_after_texts,
    raw=st.none() | st.floats(allow_nan=True, allow_infinity=True),
)
def test_every_wait_is_finite_inside_its_band_and_bounded_by_the_clamp(
    schedule, jitter, clamp, seed, header, raw
):
    policy = RetryPolicy(schedule=schedule, jitter=jitter, retry_after_max=clamp)
    rng = random.Random(seed)
    for n, base in enumerate(schedule, start=1):
        # Half the time the value a receiver's header parses to, half a raw float (NaN,
        # infinities and negatives included) as a caller could pass.
        retry_after = parse_retry_after(header, now=NOW) if n % 2 else raw
        delay = policy.next_delay(n, retry_after=retry_after, rng=rng)

        assert math.isfinite(delay)
        assert delay >= base * (1 - jitter) - 1e-6  # Retry-After never shortens a step
        assert delay <= max(base * (1 + jitter), clamp) + 1e-6  # and never passes the clamp
        timedelta(seconds=delay)  # what state.py does with it; must not overflow


@PROPERTY
@given(schedule=schedules, jitter=st.floats(0, 0.99), seed=st.integers(), extra=st.integers(1, 50))
def test_the_schedule_ends_after_exactly_its_length_whatever_is_asked(
    schedule, jitter, seed, extra
):
    """Bounded: ``len(schedule) + 1`` attempts, then dead, even if a receiver keeps asking
    to be called back, and the whole life of a delivery is bounded by the steps' top band
    plus one clamp per step."""
    policy = RetryPolicy(schedule=schedule, jitter=jitter, retry_after_max=3600)
    rng = random.Random(seed)
    waits = [policy.next_delay(n, retry_after=10**9, rng=rng) for n in range(1, len(schedule) + 1)]

    assert all(w is not None for w in waits)
    assert policy.max_attempts == len(schedule) + 1
    for n in range(len(schedule) + 1, len(schedule) + 1 + extra):
        assert policy.next_delay(n, retry_after=10**9, rng=rng) is None
    assert sum(waits) <= sum(schedule) * (1 + jitter) + 3600 * len(schedule) + 1e-3


@PROPERTY
@given(
    schedule=st.lists(steps, min_size=2, max_size=12).map(sorted).map(tuple),
    jitter=st.floats(0, 0.99),
    seed=st.integers(),
    header=st.none() | retry_after_texts,
)
def test_a_non_decreasing_schedule_gives_non_decreasing_bands_and_increasing_retry_times(
    schedule, jitter, seed, header
):
    """Monotonic: the band of each wait starts no earlier and ends no earlier than the
    band before it, and, since every wait is counted from the attempt before, the retry
    times only move forward (strictly, once the steps are positive)."""
    policy = RetryPolicy(schedule=schedule, jitter=jitter)
    rng = random.Random(seed)
    retry_after = parse_retry_after(header, now=NOW)
    bands = [(b * (1 - jitter), b * (1 + jitter)) for b in schedule]
    # The policy's own waits (no Retry-After) fall in their bands, so the bands' order
    # is the waits' order.
    for n, (low, high) in enumerate(bands, start=1):
        wait = policy.next_delay(n, retry_after=None, rng=rng)
        assert low - 1e-6 <= wait <= high + 1e-6, (n, wait, low, high)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in itertools.pairwise(bands))

    at, times = 0.0, []
    for n in range(1, len(schedule) + 1):
        at += policy.next_delay(n, retry_after=retry_after, rng=rng)
        times.append(at)
    assert times == sorted(times)
    if schedule[0] > 0:
        assert all(b > a for a, b in itertools.pairwise(times))


@PROPERTY
@given(base=st.floats(1e-3, 10**6), jitter=st.floats(0.01, 0.99), seed=st.integers())
def test_jitter_uses_both_halves_of_its_band(base, jitter, seed):
    """Jitter in range, and really spread: 64 draws land both below and above the step."""
    policy = RetryPolicy(schedule=(base,), jitter=jitter)
    rng = random.Random(seed)
    delays = [policy.next_delay(1, rng=rng) for _ in range(64)]

    assert all(base * (1 - jitter) - 1e-9 <= d <= base * (1 + jitter) + 1e-9 for d in delays)
    assert min(delays) < base < max(delays)


@pytest.mark.parametrize(
    "options",
    [
        {"schedule": (5, math.nan)},
        {"schedule": (math.inf,)},
        {"schedule": (-1,)},
        # A step that schedules nothing later: under a millisecond, down to the subnormal
        # float hypothesis found (5e-324 with jitter 0.75 rounds to no wait at all).
        {"schedule": (5, 5e-324)},
        {"schedule": (0.0009,)},
        {"schedule": (5,), "jitter": math.nan},
        {"schedule": (5,), "jitter": 1.0},
        {"schedule": (5,), "retry_after_max": math.nan},
        {"schedule": (5,), "retry_after_max": math.inf},
        {"schedule": (5,), "retry_after_max": -1},
    ],
)
def test_a_policy_that_could_schedule_nan_or_infinity_is_refused(options):
    with pytest.raises(ValueError):
        RetryPolicy(**options)


def test_a_non_finite_schedule_in_settings_fails_the_system_check(settings):
    from deliveries.checks import check_delivery_settings, check_setting_types

    # No number at all: the setting does not read (one error, naming the item); a number
    # the policy refuses: the policy's own error.
    settings.DELIVERY_RETRY_SCHEDULE = [5.0, math.inf]
    assert [e.id for e in check_setting_types(None)] == ["deliveries.E040"]
    assert "item 2" in check_setting_types(None)[0].msg
    settings.DELIVERY_RETRY_SCHEDULE = [5.0, -1.0]
    assert check_setting_types(None) == []
    assert "deliveries.E001" in [e.id for e in check_delivery_settings(None)]
