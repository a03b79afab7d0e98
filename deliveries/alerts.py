"""Alerts as data: the service records incidents about itself as ``OperationalEvent``
rows (visible in the admin) and notifies an operator once per incident.

Conditions come from *checks*, functions ``check(now) -> list[Signal]`` run by
``alerts_check`` (``manage.py check_alerts``, or the django-q2 schedule
``deliveries.schedules.alerts_pass``, every minute), and from code that sees an incident
happen (the workers, when they disable an endpoint). Other apps register their checks
from ``AppConfig.ready`` (``ingest`` registers the verification-failure spike).

One incident, one message: a signal for a (kind, key) that already has an open incident
refreshes it; the notifier claims each new incident with a guarded UPDATE on
``notified_at`` and, in that same transaction, publishes the webhook notification as an
ordinary event to the ALERTS_TENANT's endpoints (signed, retried and logged like every
delivery). The email goes after the commit, at most once.

Incidents about one tenant's endpoint (disabled; failing for TENANT_NOTIFY_FAILING_AFTER)
are the tenant's to hear about too: in the same claiming transaction an
``endpoint.disabled`` or ``endpoint.failing`` event is published to the tenant's other
endpoints that subscribe to it by name (or ``endpoint.*``), never to the endpoint the
incident is about; after the commit one email goes to the tenant's
``notification_email``. A failing endpoint is the tenant's alone: operators hear of it
when it is disabled.
"""

import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import Count, F
from django.utils import timezone

from deliveries.core.alerts import CHECKS, Signal, register_check
from deliveries.core.conf import settings
from deliveries.core.prometheus import OPERATIONAL_EVENTS, TENANT_NOTIFICATIONS

from . import catalogue
from .jobs.models import Job, JobState
from .models import AlertCheckpoint, Delivery, DeliveryState, Endpoint, OperationalEvent, Tenant
from .services import DomainError, publish_event

logger = logging.getLogger("deliveries.alerts")

ALERT_EVENT_TYPE = "operations.alert"
Kind = OperationalEvent.Kind
# The incidents a tenant is told about, and the event type its webhook carries.
TENANT_EVENT_TYPES = {
    Kind.ENDPOINT_DISABLED: "endpoint.disabled",
    Kind.ENDPOINT_FAILING: "endpoint.failing",
}
# The incidents only the tenant is told about.
TENANT_ONLY = frozenset({Kind.ENDPOINT_FAILING})


# --- Recording ---------------------------------------------------------------------------


def operational_event_record(*, signal: Signal, now: datetime) -> tuple[OperationalEvent, bool]:
    """Open an incident for ``signal``, or refresh the open one for its (kind, key).
    Returns the incident and whether it was opened now. The partial unique constraint
    operational_event_open makes two concurrent recorders agree on one incident."""
    refresh = {
        "last_seen_at": now,
        "occurrences": F("occurrences") + 1,
        "summary": signal.summary[:500],
        "details": signal.details,
    }
    for _ in range(3):
        open_ = OperationalEvent.objects.filter(
            kind=signal.kind, key=signal.key, resolved_at__isnull=True
        )
        if open_.update(**refresh):
            event = open_.first()
            if event is not None:  # else it was resolved in between: open a new one
                return event, False
        try:
            with transaction.atomic():
                event = OperationalEvent.objects.create(
                    kind=signal.kind,
                    key=signal.key[:200],
                    severity=signal.severity,
                    summary=signal.summary[:500],
                    details=signal.details,
                    first_seen_at=now,
                    last_seen_at=now,
                )
        except IntegrityError:  # another process opened it first: refresh that one
            continue
        OPERATIONAL_EVENTS.labels(signal.kind).inc()
        logger.warning(
            signal.summary,
            extra={
                "action": "alert.opened",
                "kind": signal.kind,
                "key": signal.key,
                "incident_id": event.id,
                "severity": signal.severity,
            },
        )
        return event, True
    raise RuntimeError("could not record the operational event")  # pragma: no cover


def endpoint_disabled_signal(endpoint_ids: Iterable, *, now: datetime | None = None) -> None:
    """The workers disabled these endpoints (410 Gone, or failing too long)."""
    now = now or timezone.now()
    for endpoint in Endpoint.objects.filter(id__in=list(endpoint_ids)).select_related("tenant"):
        operational_event_record(
            signal=Signal(
                kind=Kind.ENDPOINT_DISABLED,
                key=str(endpoint.id),
                severity=OperationalEvent.Severity.CRITICAL,
                summary=f"Endpoint of tenant {endpoint.tenant.name} disabled: "
                f"{endpoint.disabled_reason}",
                details={
                    **_endpoint_details(endpoint),
                    "reason": endpoint.disabled_reason,
                    "disabled_at": _iso(endpoint.disabled_at),
                },
            ),
            now=now,
        )


def _endpoint_details(endpoint: Endpoint) -> dict:
    return {
        "endpoint_id": str(endpoint.id),
        "tenant_id": str(endpoint.tenant_id),
        "tenant": endpoint.tenant.name,
        # The host only: a query string may carry a receiver's token.
        "host": urlsplit(endpoint.url).hostname or "",
        "failing_since": _iso(endpoint.failing_since),
    }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


# --- Checks ------------------------------------------------------------------------------


def checkpoint(name: str, now: datetime, *, first_lookback: float = 60.0) -> AlertCheckpoint:
    """The named checkpoint, locked until the transaction ends (so two checkers do not
    both count the same interval). Call inside ``transaction.atomic()``."""
    AlertCheckpoint.objects.get_or_create(
        name=name, defaults={"checked_at": now - timedelta(seconds=first_lookback)}
    )
    return AlertCheckpoint.objects.select_for_update().get(name=name)


@contextlib.contextmanager
def checked_since(name: str, now: datetime) -> Iterator[datetime]:
    """The interval a check counts: yields the end of the previous one, under the named
    checkpoint's lock, and moves the checkpoint to ``now`` when the block ends."""
    with transaction.atomic():
        mark = checkpoint(name, now)
        yield mark.checked_at
        mark.checked_at = now
        mark.save(update_fields=["checked_at"])


def dead_letter_check(now: datetime) -> list[Signal]:
    """Deliveries that went dead since the previous check (index delivery_dead; the
    alerts tenant's own deliveries are left out, so a dead operator endpoint does not
    report itself)."""
    with checked_since("dead_letters", now) as since:
        dead = Delivery.objects.filter(
            state=DeliveryState.DEAD, finished_at__gt=since, finished_at__lte=now
        )
        if settings.ALERTS_TENANT:
            dead = dead.exclude(tenant__name=settings.ALERTS_TENANT)
        by_endpoint = list(
            dead.values_list("endpoint_id").annotate(n=Count("id")).order_by("-n")[:1000]
        )
    total = sum(n for _, n in by_endpoint)
    if total < settings.ALERTS_DEAD_LETTER_THRESHOLD:
        return []
    return [
        Signal(
            kind=Kind.DEAD_LETTERS,
            key="all",
            summary=f"{total} deliveries dead-lettered since {since.isoformat()}",
            details={
                "count": total,
                "since": since.isoformat(),
                "until": now.isoformat(),
                "endpoints": {str(e): n for e, n in by_endpoint[:10]},
            },
        )
    ]


register_check("dead_letters", dead_letter_check)


def dead_job_check(now: datetime) -> list[Signal]:
    """The host's background jobs that went dead since the previous check (index
    job_dead), counted by type, with the latest ten and their reasons."""

    with checked_since("dead_jobs", now) as since:
        dead = Job.objects.filter(state=JobState.DEAD, finished_at__gt=since, finished_at__lte=now)
        by_type = list(dead.values_list("type").annotate(n=Count("id")).order_by("-n")[:1000])
        latest = list(dead.order_by("-finished_at").values_list("type", "id", "dead_reason")[:10])
    total = sum(n for _, n in by_type)
    if not total or total < settings.ALERTS_DEAD_LETTER_THRESHOLD:
        return []
    return [
        Signal(
            kind=Kind.DEAD_JOBS,
            key="all",
            summary=f"{total} background jobs dead since {since.isoformat()}",
            details={
                "count": total,
                "since": since.isoformat(),
                "until": now.isoformat(),
                "types": dict(by_type[:10]),
                "latest": [
                    {"type": t, "job_id": str(i), "reason": reason[:200]} for t, i, reason in latest
                ],
            },
        )
    ]


register_check("dead_jobs", dead_job_check)


def endpoint_failing_check(now: datetime) -> list[Signal]:
    """Enabled endpoints failing for longer than TENANT_NOTIFY_FAILING_AFTER (index
    endpoint_failing), one incident each while they fail: their tenants are told once
    (the alerts tenant's own endpoints are left out)."""
    after = settings.TENANT_NOTIFY_FAILING_AFTER
    if after <= 0:
        return []
    failing = Endpoint.objects.filter(
        enabled=True, failing_since__lt=now - timedelta(seconds=after)
    ).select_related("tenant")
    if settings.ALERTS_TENANT:
        failing = failing.exclude(tenant__name=settings.ALERTS_TENANT)
    return [
        Signal(
            kind=Kind.ENDPOINT_FAILING,
            key=str(endpoint.id),
            summary=f"Endpoint of tenant {endpoint.tenant.name} failing since "
            f"{endpoint.failing_since.isoformat()}",
            details=_endpoint_details(endpoint),
        )
        for endpoint in failing.order_by("failing_since")[:1000]
    ]


register_check("endpoint_failing", endpoint_failing_check)


# --- Running and notifying ---------------------------------------------------------------


def alerts_check(*, now: datetime | None = None) -> Counter:
    """One pass: run every check, record what it signals, resolve incidents quiet for
    ALERTS_RESOLVE_AFTER, then notify the new ones."""
    now = now or timezone.now()
    counts: Counter = Counter()
    for name, check in CHECKS.items():
        for signal in check(now):
            _, opened = operational_event_record(signal=signal, now=now)
            counts["opened" if opened else "refreshed"] += 1
        counts[f"checked.{name}"] += 1
    counts["resolved"] = OperationalEvent.objects.filter(
        resolved_at__isnull=True,
        last_seen_at__lt=now - timedelta(seconds=settings.ALERTS_RESOLVE_AFTER),
    ).update(resolved_at=now)
    counts["notified"] = notify_pending(now=now)
    return counts


def notify_pending(*, now: datetime, limit: int = 100) -> int:
    """Notify incidents not yet notified, each at most once (index
    operational_event_unnotified)."""
    sent = 0
    pending = OperationalEvent.objects.filter(notified_at__isnull=True).order_by("first_seen_at")
    for incident in list(pending[:limit]):
        with transaction.atomic():
            if not OperationalEvent.objects.filter(id=incident.id, notified_at__isnull=True).update(
                notified_at=now
            ):
                continue  # another notifier claimed it
            outcome = {}
            if incident.kind not in TENANT_ONLY:
                outcome["webhook"] = _publish_alert(incident)
            if incident.kind in TENANT_EVENT_TYPES:
                outcome["tenant_webhook"] = _publish_tenant_notice(incident)
            OperationalEvent.objects.filter(id=incident.id).update(notification=outcome)
        if incident.kind not in TENANT_ONLY:
            outcome["email"] = _email_alert(incident)
        if incident.kind in TENANT_EVENT_TYPES:
            outcome["tenant_email"] = _email_tenant(incident)
        OperationalEvent.objects.filter(id=incident.id).update(notification=outcome)
        logger.info(
            "operator notified",
            extra={"action": "alert.notified", "incident_id": incident.id, **outcome},
        )
        sent += 1
    return sent


def _payload(incident: OperationalEvent) -> dict:
    return {
        "incident_id": incident.id,
        "kind": incident.kind,
        "key": incident.key,
        "severity": incident.severity,
        "summary": incident.summary,
        "details": incident.details,
        "first_seen_at": incident.first_seen_at.isoformat(),
    }


def _publish_alert(incident: OperationalEvent) -> str:
    """The webhook: an ``operations.alert`` event to the ALERTS_TENANT's endpoints, in
    the claiming transaction (so it exists exactly when the claim does)."""
    if not settings.ALERTS_TENANT:
        return "off"

    tenant = Tenant.objects.filter(name=settings.ALERTS_TENANT).first()
    if tenant is None:
        return f"no tenant named {settings.ALERTS_TENANT!r}"
    event = publish_event(
        tenant=tenant,
        event_type=ALERT_EVENT_TYPE,
        payload=_payload(incident),
        entity_id=f"incident:{incident.id}",
        priority=10,
    )
    return f"event {event.id}"


def _email_alert(incident: OperationalEvent) -> str:
    if not settings.ALERTS_EMAIL_TO:
        return "off"
    lines = [incident.summary, ""]
    lines += [f"{k}: {v}" for k, v in incident.details.items()]
    lines += ["", f"kind: {incident.kind}", f"first seen: {incident.first_seen_at.isoformat()}"]
    try:
        send_mail(
            subject=f"[webhooks] {incident.severity}: {incident.summary}"[:200],
            message="\n".join(lines),
            from_email=settings.ALERTS_EMAIL_FROM or None,
            recipient_list=settings.ALERTS_EMAIL_TO,
        )
    except Exception as exc:  # SMTP trouble is recorded, not retried: one message at most
        logger.warning(
            "alert email failed",
            extra={"action": "alert.email_failed", "incident_id": incident.id, "error": str(exc)},
        )
        return f"failed: {type(exc).__name__}"
    return "sent"


# --- Telling the tenant ------------------------------------------------------------------


def _incident_endpoint(incident: OperationalEvent) -> Endpoint | None:
    endpoint_id = incident.details.get("endpoint_id")
    return (
        Endpoint.objects.filter(id=endpoint_id).select_related("tenant").first()
        if endpoint_id
        else None
    )


def tenant_notice_payload(incident: OperationalEvent, endpoint: Endpoint) -> dict:
    """The body of an ``endpoint.disabled`` / ``endpoint.failing`` event (its schema is
    in the catalogue, migration 0030)."""
    return {
        "endpoint_id": str(endpoint.id),
        "url_host": urlsplit(endpoint.url).hostname or "",
        "enabled": endpoint.enabled,
        "reason": endpoint.disabled_reason,
        "failing_since": _iso(endpoint.failing_since),
        "disabled_at": _iso(endpoint.disabled_at),
        "incident_id": incident.id,
        "occurred_at": incident.first_seen_at.isoformat(),
    }


def _publish_tenant_notice(incident: OperationalEvent) -> str:
    """The tenant's webhook, in the claiming transaction: an event of the incident's
    tenant type to the tenant's enabled endpoints whose filter names it (an empty filter
    does not: operational notices are asked for), never to the endpoint it is about."""

    event_type = TENANT_EVENT_TYPES[incident.kind]
    endpoint = _incident_endpoint(incident)
    if endpoint is None:
        return _counted(incident, "webhook", "endpoint gone")
    targets = [
        other.id
        for other in Endpoint.objects.filter(tenant_id=endpoint.tenant_id, enabled=True)
        .exclude(id=endpoint.id)
        .only("id", "event_types")
        if other.event_types and catalogue.matches(other.event_types, event_type)
    ]
    if not targets:
        return _counted(incident, "webhook", "no endpoint subscribed")
    try:
        with transaction.atomic():  # a refusal leaves the claim standing
            event = publish_event(
                tenant=endpoint.tenant_id,
                event_type=event_type,
                payload=tenant_notice_payload(incident, endpoint),
                entity_id=f"endpoint:{endpoint.id}",
                priority=10,
                endpoint_ids=targets,
            )
    except DomainError as exc:
        _counted(incident, "webhook", "refused")
        return f"refused: {exc.code}"
    _counted(incident, "webhook", "sent")
    return f"event {event.id} to {len(targets)} endpoint(s)"


def _email_tenant(incident: OperationalEvent) -> str:
    endpoint = _incident_endpoint(incident)
    if endpoint is None:
        return _counted(incident, "email", "endpoint gone")
    address = endpoint.tenant.notification_email
    if not address:
        return _counted(incident, "email", "off")
    host = urlsplit(endpoint.url).hostname or "your endpoint"
    if incident.kind == Kind.ENDPOINT_DISABLED:
        subject = f"Webhooks to {host} are stopped: the endpoint was disabled"
        what = [
            f"We disabled your webhook endpoint at {host}: {endpoint.disabled_reason}.",
            "Deliveries to it have stopped. Once the receiver answers again, enable the",
            "endpoint and recover the failed deliveries, from your webhooks portal or the",
            "API (POST /api/v1/deliveries/recover/).",
        ]
    else:
        subject = f"Webhooks to {host} are failing"
        what = [
            f"Deliveries to your webhook endpoint at {host} have been failing since",
            f"{endpoint.failing_since:%Y-%m-%d %H:%M} UTC. They are being retried; if the",
            "endpoint keeps failing it will be disabled. The delivery history in your",
            "webhooks portal shows each attempt and the answer your receiver gave.",
        ]
    lines = [*what, "", f"Endpoint id: {endpoint.id}", f"Incident: {incident.id}"]
    try:
        send_mail(
            subject=subject,
            message="\n".join(lines),
            from_email=settings.ALERTS_EMAIL_FROM or None,
            recipient_list=[address],
        )
    except Exception as exc:  # recorded, not retried: one message at most
        logger.warning(
            "tenant email failed",
            extra={
                "action": "alert.tenant_email_failed",
                "incident_id": incident.id,
                "tenant_id": str(endpoint.tenant_id),
                "error": str(exc)[:200],
            },
        )
        _counted(incident, "email", "failed")
        return f"failed: {type(exc).__name__}"
    return _counted(incident, "email", "sent")


def _counted(incident: OperationalEvent, channel: str, outcome: str) -> str:
    TENANT_NOTIFICATIONS.labels(incident.kind, channel, outcome.replace(" ", "_")).inc()
    return outcome
