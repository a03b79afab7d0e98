"""Reads: queries and explanations, no writes."""

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from deliveries.core.conf import settings

from .core.egress import USER_AGENT, EgressPolicy, IPNetwork, match_allowances
from .core.headers import DROPPED, NOT_STORED, PROTOCOL_HEADERS, REDACTED
from .jobs.brokers import broker_class, takes_outbox
from .jobs.models import LoopRun, Outbox
from .jobs.outbox import message_key
from .models import Attempt, Delivery, DeliveryState, Endpoint, Outcome, Tenant
from .signing import protocol_headers
from .statements import DELIVERY_KIND, reads

logger = logging.getLogger("deliveries.selectors")

# A loop that missed this many heartbeats (LOOP_HEARTBEAT_SECONDS apart, 60 s with the
# default period) is taken as not running: a few late beats (a slow database) are not
# a stopped process.
LOOP_STALE_BEATS = 6


def loop_stale_after() -> timedelta:
    return timedelta(seconds=LOOP_STALE_BEATS * settings.LOOP_HEARTBEAT_SECONDS)


@dataclass
class Explanation:
    """Where a delivery stands, in one sentence an operator can act on.

    ``kind``: waiting (late by policy), held (its endpoint is paused), due, outbox,
    in_transport, leased, succeeded, dead, or stalled (nothing that would move it is
    running: late, and will stay late until someone starts it)."""

    kind: str
    sentence: str
    details: list[str] = field(default_factory=list)


def _t(moment: datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S}" if moment else "an unrecorded time"


def _paused_since(delivery: Delivery) -> str:
    """How its endpoint was paused ("at <time> UTC (<reason>)"), or "" if it is not."""
    try:
        endpoint = delivery.endpoint
    except Endpoint.DoesNotExist:  # deleted meanwhile: its deliveries go with it
        return ""
    if endpoint.paused_at is None:
        return ""
    why = f" ({endpoint.paused_reason})" if endpoint.paused_reason else ""
    return f"at {_t(endpoint.paused_at)} UTC{why}"


# What each classified outcome means, as the console and the explanations say it:
# (a short label for a column, what happened in a sentence). deliveries.policy.classify
# is the table that decides them (docs/retry-policy.md).
OUTCOMES: dict[str, tuple[str, str]] = {
    Outcome.SUCCESS: ("delivered", "the receiver answered 2xx"),
    Outcome.RETRY: (
        "failed, retried",
        "a failure worth retrying (a 5xx, 408, 425 or 429 answer, a timeout or no connection)",
    ),
    Outcome.PERMANENT: ("refused", "the receiver refused it, and that is not retried"),
    Outcome.ENDPOINT_GONE: (
        "endpoint gone",
        "the receiver answered 410 Gone, which stops deliveries: its endpoint was disabled",
    ),
    Outcome.BLOCKED: (
        "blocked by the egress guard",
        "the endpoint's address is one the egress guard refuses, so nothing was sent",
    ),
    Outcome.ENDPOINT_DISABLED: (
        "endpoint disabled",
        "its endpoint was disabled before it was sent, so nothing was sent",
    ),
    Outcome.CANCELLED: ("cancelled", "an operator cancelled it before it was sent"),
    Outcome.LEASE_EXPIRED: (
        "worker lost",
        "the worker sending it stopped (its lease ran out); it may have reached the receiver",
    ),
    Outcome.TRANSPORT_LOST: (
        "lost in transport",
        "the queue lost its message, so the scheduler dispatched it again",
    ),
}

# Why an attempt got no HTTP answer (deliveries.core.egress.ErrorKind).
ERROR_KINDS: dict[str, str] = {
    "blocked": "address refused by the egress guard",
    "dns": "name not found",
    "connect": "could not connect",
    "timeout": "no answer in time",
    "tls": "TLS failure",
    "protocol": "broken HTTP answer",
    "invalid_url": "invalid URL",
}


def outcome_label(outcome: str) -> str:
    """A column's word for an outcome code: ``endpoint_gone`` is "endpoint gone (410)"."""
    return OUTCOMES[outcome][0] if outcome in OUTCOMES else (outcome or "—")


def outcome_sentence(outcome: str) -> str:
    return OUTCOMES[outcome][1] if outcome in OUTCOMES else outcome


def answer_of(status: int | None, error: str = "", error_kind: str = "") -> str:
    """What an attempt got: ``HTTP 503``, ``no answer in time (timeout: ...)``, ``no
    answer``."""
    if status:
        return f"HTTP {status}"
    if error_kind and error_kind in ERROR_KINDS:
        return ERROR_KINDS[error_kind] + (f" ({error})" if error else "")
    return error or "no answer"


def last_result(delivery: Delivery) -> str:
    """The last attempt's result in a few words, for the delivery log: ``HTTP 503, failed,
    retried``; "" before the first attempt."""
    d = delivery
    if not d.last_outcome:
        return ""
    label = outcome_label(d.last_outcome)
    if d.last_outcome == Outcome.SUCCESS:
        return f"{label} (HTTP {d.last_status_code})" if d.last_status_code else label
    if d.last_outcome in (Outcome.RETRY, Outcome.PERMANENT, Outcome.ENDPOINT_GONE):
        answer = answer_of(d.last_status_code, d.last_error)
        if d.state == DeliveryState.DEAD and d.last_outcome == Outcome.RETRY:
            return f"{answer}: retries used up"
        return f"{answer}: {label}"
    return label


def dead_reason(delivery: Delivery) -> str:
    """Why a dead delivery is dead, as a sentence (no codes)."""
    d = delivery
    answer = answer_of(d.last_status_code, d.last_error)
    attempts = f"{d.attempt_count} attempt" + ("s" if d.attempt_count != 1 else "")
    if d.last_outcome == Outcome.RETRY:
        return (
            f"It failed on every try the retry schedule allows ({attempts}); the last got {answer}."
        )
    if d.last_outcome == Outcome.PERMANENT:
        if d.last_status_code and 300 <= d.last_status_code < 400:
            return f"The receiver answered with a redirect ({answer}), which is never followed."
        return f"The receiver refused it with {answer}, which is not retried."
    if d.last_outcome == Outcome.LEASE_EXPIRED:
        return (
            f"Its worker stopped during the last attempt allowed ({attempts}); the request "
            "may have reached the receiver."
        )
    if d.last_outcome == Outcome.BLOCKED:
        return "The egress guard refused the endpoint's address" + (
            f" ({d.last_error})." if d.last_error else "."
        )
    if d.last_outcome in OUTCOMES:
        return outcome_sentence(d.last_outcome).capitalize() + "."
    return f"It ended without a recorded reason after {attempts}."


def _loop_alive(kind: str, now: datetime) -> bool:
    return LoopRun.objects.filter(
        kind=kind, finished_at__isnull=True, heartbeat_at__gte=now - loop_stale_after()
    ).exists()


def delivery_explain(delivery: Delivery, *, now: datetime | None = None) -> Explanation:
    now = now or timezone.now()
    d = delivery
    last = ""
    if d.last_outcome and d.last_outcome != Outcome.SUCCESS:
        # "after HTTP 503 (failed, retried)", "after no answer in time (failed, retried)"
        answer = answer_of(d.last_status_code, d.last_error)
        last = f" after {answer} ({outcome_label(d.last_outcome)})"
        if d.last_outcome in (Outcome.LEASE_EXPIRED, Outcome.TRANSPORT_LOST):
            last = f" after its last try was {outcome_label(d.last_outcome)}"
    details = [
        f"webhook-id: {d.id}",
        f"attempts: {d.attempt_count} (counted against the schedule: {d.policy_attempts})",
        f"dispatches: {d.dispatch_count}, lease expiries: {d.lease_expiries}",
    ]
    state = d.state
    # Read for the states a pause changes (the callers load the endpoint with the row).
    paused = (
        _paused_since(d)
        if state in (DeliveryState.PENDING, DeliveryState.ENQUEUED, DeliveryState.LEASED)
        else ""
    )
    if state == DeliveryState.PENDING and paused:
        return Explanation(
            "held",
            f"Held: its endpoint was paused {paused}. "
            + (
                f"It waits by policy until {_t(d.next_attempt_at)} UTC{last} and then "
                "for the resume."
                if d.next_attempt_at > now
                else "Nothing is sent until the endpoint is resumed; then it is due at once."
            ),
            details,
        )
    if state == DeliveryState.PENDING and d.next_attempt_at > now:
        return Explanation(
            "waiting",
            f"Waiting by policy until {_t(d.next_attempt_at)} UTC{last}.",
            details,
        )
    if state == DeliveryState.PENDING:
        if not _loop_alive("scheduler", now):
            return Explanation(
                "stalled",
                f"Due since {_t(d.next_attempt_at)} UTC, but no scheduler is "
                "running: start run_scheduler.",
                details,
            )
        return Explanation(
            "due",
            f"Due since {_t(d.next_attempt_at)} UTC; the scheduler admits it "
            "as soon as the tenant's and endpoint's in-flight ceilings allow.",
            details,
        )
    if state == DeliveryState.ENQUEUED:
        # By its unique message key: ref_id is not indexed.
        outbox = Outbox.objects.filter(
            message_key=message_key(DELIVERY_KIND, d.id, d.dispatch_count)
        ).first()
        stale_at = d.enqueued_at + timedelta(seconds=settings.SCHEDULER_STALE_ENQUEUED_SECONDS)
        if outbox and outbox.published_at is None:
            # With the database broker the workers take the outbox row themselves (a
            # relay still run beside them may take it first); else only the relay does.
            direct = takes_outbox(broker_class())
            alive = _loop_alive("relay", now) or (direct and _loop_alive("workers", now))
            taker, command = ("a worker", "run_workers") if direct else ("the relay", "run_relay")
            return Explanation(
                "outbox" if alive else "stalled",
                f"In the outbox since {_t(d.enqueued_at)} UTC, waiting for {taker}"
                + ("." if alive else f", but none is running: start {command}."),
                details,
            )
        if now > stale_at:
            return Explanation(
                "in_transport",
                f"Handed to the transport at {_t(d.enqueued_at)} UTC and not taken by "
                "a worker since: the transport lost it; the scheduler dispatches it again.",
                details,
            )
        if paused:
            return Explanation(
                "held",
                f"Handed to the transport at {_t(d.enqueued_at)} UTC, before its endpoint "
                f"was paused {paused}: the worker that takes it returns it to pending "
                "without sending it, to wait for the resume.",
                details,
            )
        alive = _loop_alive("workers", now)
        return Explanation(
            "in_transport" if alive else "stalled",
            f"In transport since {_t(d.enqueued_at)} UTC (dispatch {d.dispatch_count})"
            + ("; a worker will take it." if alive else ", but no worker is running."),
            details,
        )
    if state == DeliveryState.LEASED:
        if d.lease_until < now:
            return Explanation(
                "leased",
                f"The worker's lease ran out at {_t(d.lease_until)} UTC (it died or hung); "
                "the scheduler returns the delivery to pending.",
                details,
            )
        return Explanation(
            "leased",
            f"Leased by a worker until {_t(d.lease_until)} UTC: attempt "
            f"{d.attempt_count} is in flight"
            + (
                f". Its endpoint was paused {paused}, after it was sent: this attempt "
                "is recorded as usual, and a retry waits for the resume."
                if paused
                else "."
            ),
            details,
        )
    if state == DeliveryState.SUCCEEDED:
        return Explanation(
            "succeeded",
            f"Succeeded at {_t(d.finished_at)} UTC with HTTP {d.last_status_code} "
            f"after {d.attempt_count} attempt(s).",
            details,
        )
    return Explanation(
        "dead",
        f"Dead since {_t(d.finished_at)} UTC. {dead_reason(d)} Replay sends it again with "
        "the same webhook-id.",
        details,
    )


# --- What an attempt sent ------------------------------------------------------------------


def attempt_request_headers(attempt: Attempt) -> dict[str, str]:
    """The request headers of ``attempt`` as its receiver got them, in the order they were
    sent, for the portal, the admin and the API alike.

    The attempt log keeps only what varies (deliveries.worker): the timestamp signed and
    the names of the endpoint's custom headers. The rest follows from the protocol
    (deliveries.signing; webhook-id and Idempotency-Key are the delivery id) and the
    HTTP client's User-Agent (deliveries.core.egress). A value the log does not keep is a
    marker: ``[redacted]`` for a custom header's (it may be a credential, so a value
    found in an older row is masked too), ``[not stored]`` for the signature (one
    ``v1,…`` per secret signing then). Headers the header rule kept back come last,
    ``[dropped]``: they were not sent."""
    recorded = attempt.request_headers if isinstance(attempt.request_headers, dict) else {}
    custom = [n for n, v in recorded.items() if v != DROPPED and n.lower() not in PROTOCOL_HEADERS]
    dropped = [name for name, value in recorded.items() if value == DROPPED]
    timestamp = recorded.get("webhook-timestamp")
    if timestamp in (None, DROPPED):  # an older row's, whose dropped namesake replaced it
        timestamp = NOT_STORED
    headers = dict.fromkeys(custom, REDACTED)
    delivery_id = str(attempt.delivery_id)
    headers.update(protocol_headers(msg_id=delivery_id, timestamp=timestamp, signature=NOT_STORED))
    if not any(name.lower() == "user-agent" for name in custom):
        headers["User-Agent"] = USER_AGENT
    # A dropped name the protocol also sets: the protocol's header is the one sent.
    headers.update({name: DROPPED for name in dropped if name not in headers})
    return headers


# --- Egress allowances -----------------------------------------------------------------


def allowed_networks(
    targets: Iterable[tuple[uuid.UUID | None, uuid.UUID | None]],
) -> dict[tuple[uuid.UUID | None, uuid.UUID | None], tuple[IPNetwork, ...]]:
    """The networks staff opened for each (tenant id, endpoint id or None) target
    (``match_allowances`` says which count). One query for all the targets (a worker's
    batch): the targets' tenants' rows, by the tenant index. On PostgreSQL the tenant ids
    travel as one array parameter (deliveries.core.sql): the ORM's IN list of a
    200-target batch cost 3.5 ms."""
    targets = set(targets)
    tenant_ids = list({t for t, _ in targets if t is not None})  # None: the operator's own
    rows = reads.TENANT_ALLOWANCES([tenant_ids]) if tenant_ids else []
    return match_allowances(targets, rows)


def egress_policy_for(
    *, tenant_id: uuid.UUID | None, endpoint_id: uuid.UUID | None = None
) -> EgressPolicy:
    """The egress policy of one tenant's (endpoint's) requests: EGRESS_ALLOW_NETWORKS and
    what staff opened for it (no tenant: EGRESS_ALLOW_NETWORKS alone). For an endpoint's
    URL at creation or change and a poll source's requests; the worker asks for a whole
    batch at once (``allowed_networks``)."""
    extra = allowed_networks([(tenant_id, endpoint_id)])[(tenant_id, endpoint_id)]
    return EgressPolicy.from_settings().widened(extra)


def delivery_trace_contexts(delivery_ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    """The W3C traceparent each delivery's event was published under, where it has one."""
    return dict(
        Delivery.objects.filter(id__in=delivery_ids)
        .exclude(event__trace_context="")
        .values_list("id", "event__trace_context")
    )


def tenant_choices(limit: int = 200) -> list[tuple[str, str]]:
    """(id, name) of the first tenants by name: the choices of the admin's tenant
    filters (the background jobs' too, through deliveries.jobs.services)."""
    tenants = Tenant.objects.order_by("name").values_list("id", "name")[:limit]
    return [(str(i), name) for i, name in tenants]
