"""Reads for polling and backfill."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from .models import (
    BackfillRun,
    BackfillState,
    InboundEvent,
    InboundState,
    Source,
    VerificationFailure,
)


@dataclass(frozen=True)
class Progress:
    """Where a backfill stands, for the admin, the REST API and the progress bar."""

    fraction: float  # 0..1 of the window (of the provider's total if it gave one)
    processed: int
    total: int | None
    records_per_second: float
    requests_per_second: float
    eta_seconds: float | None  # None when not running or nothing to go on yet
    checkpoint: datetime | None


def backfill_progress(
    run: BackfillRun,
    *,
    processed: int | None = None,
    requests: int | None = None,
    active_seconds: float | None = None,
    checkpoint: datetime | None = None,
    total: int | None = None,
) -> Progress:
    """The run's progress; the keyword arguments override the stored figures (the
    command passes its live ones between checkpoints). The fraction is of the provider's
    total when one is known, else of the window up to the checkpoint."""
    total = run.total if total is None else total
    processed = run.processed if processed is None else processed
    requests = run.requests if requests is None else requests
    active = run.active_seconds if active_seconds is None else active_seconds
    checkpoint = checkpoint or run.checkpoint_at
    if run.state == BackfillState.COMPLETED:
        fraction = 1.0
    elif total:
        fraction = min(processed / total, 1.0)
    elif checkpoint is not None:
        window = (run.until - run.since).total_seconds()
        fraction = min(max((checkpoint - run.since).total_seconds() / window, 0.0), 1.0)
    else:
        fraction = 0.0
    eta = None
    if run.state == BackfillState.RUNNING and 0 < fraction < 1 and active > 0:
        eta = active * (1 - fraction) / fraction
    return Progress(
        fraction=fraction,
        processed=processed,
        total=total,
        records_per_second=processed / active if active > 0 else 0.0,
        requests_per_second=requests / active if active > 0 else 0.0,
        eta_seconds=eta,
        checkpoint=checkpoint,
    )


# --- An event as the console shows it ----------------------------------------------------

# Keys whose values the console always masks in a body or headers, whatever the source's
# own list (Source.redact_keys) adds. Compared without case, "-" or "_".
REDACTED_KEYS = frozenset(
    {
        "password",
        "passwd",
        "secret",
        "clientsecret",
        "token",
        "accesstoken",
        "refreshtoken",
        "apikey",
        "authorization",
        "cookie",
        "cardnumber",
        "pan",
        "cvc",
        "cvv",
        "ssn",
        "iban",
    }
)
MASK = "[redacted]"
# What the event page shows of a body at most, and the largest body it parses to redact
# (a bigger one is not shown: its fields could not be masked).
BODY_SHOWN_CHARS = 20_000
BODY_PARSED_BYTES = 2 * 1024 * 1024


def _normal(key: str) -> str:
    return key.lower().replace("-", "").replace("_", "")


def redacted(value, keys: frozenset):
    """``value`` (parsed JSON) with the values of ``keys`` masked, at any depth."""
    if isinstance(value, dict):
        return {k: MASK if _normal(str(k)) in keys else redacted(v, keys) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v, keys) for v in value]
    return value


def _keys_of(source) -> frozenset:
    own = source.redact_keys if isinstance(source.redact_keys, list) else []
    return REDACTED_KEYS | {_normal(str(k)) for k in own}


@dataclass(frozen=True)
class ShownBody:
    text: str  # "" when the body is not shown
    note: str  # what the reader should know: its size, a cut, why it is not shown


def _form_lines(raw: bytes, keys: frozenset) -> str | None:
    """Form data as ``key=value`` lines, the redacted keys masked and a JSON value (a
    Slack ``payload``) redacted inside; None if it is not form data."""
    import json
    from urllib.parse import parse_qsl

    try:
        pairs = parse_qsl(raw.decode(), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    lines = []
    for key, value in pairs:
        if _normal(key) in keys:
            value = MASK
        elif value[:1] in ("{", "["):
            with contextlib.suppress(ValueError):
                value = json.dumps(redacted(json.loads(value), keys), ensure_ascii=False)
        lines.append(f"{key}={value}")
    return "\n".join(lines)


def body_shown(event, source) -> ShownBody:
    """An inbound event's body for the console: JSON pretty-printed, form data as
    ``key=value`` lines, each with the redacted keys masked, at most BODY_SHOWN_CHARS. A
    body that is neither cannot be redacted field by field, so it is not shown, only its
    size."""
    import json

    raw = bytes(event.body)
    size = f"{len(raw):,} bytes"
    if not raw:
        return ShownBody("", "empty")
    if len(raw) > BODY_PARSED_BYTES:
        return ShownBody("", f"{size}: too large to show here")
    keys = _keys_of(source)
    content_type = str((event.headers or {}).get("content-type", "")).split(";")[0].strip()
    try:
        text = json.dumps(redacted(json.loads(raw), keys), indent=2, ensure_ascii=False)
    except ValueError:
        text = (
            _form_lines(raw, keys) if content_type == "application/x-www-form-urlencoded" else None
        )
    if text is None:
        return ShownBody(
            "", f"{size}, not JSON or form data: not shown, since its fields cannot be masked"
        )
    if len(text) > BODY_SHOWN_CHARS:
        return ShownBody(
            text[:BODY_SHOWN_CHARS], f"{size}; the first {BODY_SHOWN_CHARS:,} characters shown"
        )
    return ShownBody(text, size)


def headers_shown(event, source) -> dict[str, str]:
    """The headers stored with the event (signatures and credentials were never stored),
    the redacted names masked, sorted by name."""
    keys = _keys_of(source)
    headers = event.headers if isinstance(event.headers, dict) else {}
    return {
        name: MASK if _normal(name) in keys else str(value)
        for name, value in sorted(headers.items())
    }


# --- The console's overview ---------------------------------------------------------------

# Why a request was refused (VerificationFailure.reason), as the console says it.
REFUSALS = {
    "missing_signature": "no signature header",
    "malformed_signature": "a signature header that does not parse",
    "bad_signature": "a signature that matches no live secret",
    "missing_timestamp": "no signed timestamp",
    "stale_timestamp": "a signed timestamp older than the replay window",
    "future_timestamp": "a signed timestamp too far in the future",
    "no_secret": "the source has no live secret to check with",
    "bad_header": "a header the service cannot store (NUL, a lone surrogate)",
    "content_type": "a content type the source does not take",
    "content_encoding": "a compressed or otherwise encoded body",
    "incomplete_body": "a body shorter than its Content-Length",
    "bad_framing": "a body whose length and framing disagree",
    "too_large": "a body over the source's size limit",
}


def refusal_text(reason: str) -> str:
    """``bad_signature`` as "a signature that matches no live secret"."""
    if reason in REFUSALS:
        return REFUSALS[reason]
    if reason.startswith("unparseable_"):
        detail = reason.removeprefix("unparseable_").replace("_", " ")
        return f"an authentic body that cannot be used ({detail})"
    return reason.replace("_", " ")


# Counts of received events past this are shown as "at least": a source receiving
# millions a day would otherwise cost the page a count of all of them.
RECEIPTS_CAP = 100_000


def inbound_overview(now: datetime) -> dict:
    """The overview's inbound section (deliveries.core.console.register_panel): per source,
    events received in the last 24 hours (inbound_source_received, capped), duplicates
    among them, and refusals (VerificationFailure: one row per source and reason, with
    its latest time); events waiting and dead (their partial indexes)."""
    from django.db.models import Count, Sum

    since = now - timedelta(hours=24)
    sources = []
    for source in Source.objects.order_by("slug")[:50]:
        recent = InboundEvent.objects.filter(source=source, received_at__gte=since)
        received = recent.order_by()[: RECEIPTS_CAP + 1].count()
        sources.append(
            {
                "source": source,
                "received": received,
                "capped": received > RECEIPTS_CAP,
                "refusals": [
                    {"count": f.count, "text": refusal_text(f.reason), "last_at": f.last_at}
                    for f in VerificationFailure.objects.filter(source=source).order_by("-last_at")
                ],
            }
        )
    waiting = dict(
        InboundEvent.objects.filter(
            state__in=[InboundState.PENDING, InboundState.ENQUEUED, InboundState.PROCESSING]
        )
        .values_list("state")
        .annotate(n=Count("pk"))
        .order_by()
    )
    refused_24h = (
        VerificationFailure.objects.filter(last_at__gte=since).aggregate(n=Sum("count"))["n"] or 0
    )
    return {
        "template": "admin/ingest/overview_inbound.html",
        "title": "Inbound webhooks",
        "sources": sources,
        "waiting": sum(waiting.values()),
        "refusing_sources": VerificationFailure.objects.filter(last_at__gte=since)
        .values("source")
        .distinct()
        .count(),
        "refused_recently": refused_24h,
    }
