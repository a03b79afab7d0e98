"""Classification of attempt results and the retry policy: pure, no database, no clock.

The table (also in docs/retry-policy.md):

| result                                 | outcome          | effect                          |
| -------------------------------------- | ---------------- | ------------------------------- |
| 2xx                                    | success          | succeeded                       |
| 410 Gone                               | endpoint_gone    | dead; the endpoint is disabled  |
| 408, 425, 429, 5xx                     | retry            | pending at the next step        |
| connection, DNS or TLS error           | retry            | pending at the next step        |
| timeout, connection dropped after send | retry, ambiguous | pending; the same webhook-id    |
| egress guard refused the address/URL   | blocked          | dead (retrying cannot help)     |
| 3xx (redirects are never followed)     | permanent        | dead                            |
| other 4xx                              | permanent        | dead (retry if the endpoint     |
|                                        |                  | opts in: retry_client_errors)   |

``Retry-After`` (seconds or an HTTP date) on a retryable answer replaces the backoff step
when it is longer, clamped to ``retry_after_max``.
"""

import warnings
from dataclasses import dataclass

from .core import retry
from .models import Outcome

RETRYABLE_STATUS = frozenset({408, 425, 429})
RETRYABLE_ERRORS = frozenset({"dns", "connect", "timeout", "tls", "protocol"})
PERMANENT_ERRORS = frozenset({"blocked", "invalid_url"})


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    ambiguous: bool = False

    @property
    def retryable(self) -> bool:
        return self.outcome == Outcome.RETRY


def classify(
    *,
    status: int | None,
    error_kind: str = "",
    ambiguous: bool = False,
    retry_client_errors: bool = False,
) -> Classification:
    """Classify one attempt: an HTTP status, or no status and an egress error kind."""
    if status is None:
        if error_kind in PERMANENT_ERRORS:
            return Classification(Outcome.BLOCKED)
        if error_kind in RETRYABLE_ERRORS:
            return Classification(Outcome.RETRY, ambiguous=ambiguous)
        raise ValueError(f"an attempt needs a status or a known error kind, got {error_kind!r}")
    if 200 <= status < 300:
        return Classification(Outcome.SUCCESS)
    if status == 410:
        return Classification(Outcome.ENDPOINT_GONE)
    if status in RETRYABLE_STATUS or status >= 500:
        return Classification(Outcome.RETRY)
    if 400 <= status < 500 and retry_client_errors:
        return Classification(Outcome.RETRY)
    return Classification(Outcome.PERMANENT)


# Moved to the floor (deliveries.core.retry); these names answer here for one release.
_MOVED = frozenset({"RetryPolicy", "parse_retry_after", "MIN_STEP"})


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(
            f"deliveries.policy.{name} moved to deliveries.core.retry.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(retry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
