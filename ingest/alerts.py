"""The inbound alert check: a spike of signature verification failures for a source (a
broken secret rotation, or someone probing). Registered with ``deliveries.alerts``."""

from collections import defaultdict
from datetime import datetime

from django.db import transaction

from deliveries.alerts import Kind, checkpoint
from deliveries.core.alerts import Signal
from ingest.conf import settings

from .models import VerificationFailure

# Refusals that are not about the signature (size, content type, bodies that do not
# parse) do not count toward a verification spike.
NOT_SIGNATURE = ("too_large", "content_type", "unparseable_")


def verification_failure_check(now: datetime) -> list[Signal]:
    """Failures per source since the previous check, from the (source, reason) counters
    against the baseline the checkpoint kept. The first run only takes the baseline."""
    with transaction.atomic():
        mark = checkpoint("verification_failures", now)
        baseline = mark.data.get("counts")
        rows = list(
            VerificationFailure.objects.values_list("id", "source__slug", "reason", "count")
        )
        mark.data = {"counts": {str(i): n for i, _, _, n in rows}}
        mark.checked_at = now
        mark.save(update_fields=["data", "checked_at"])
    if baseline is None:
        return []
    by_source: dict[str, dict[str, int]] = defaultdict(dict)
    for row_id, slug, reason, count in rows:
        if reason.startswith(NOT_SIGNATURE):
            continue
        delta = count - baseline.get(str(row_id), 0)
        if delta > 0:
            by_source[slug][reason] = delta
    threshold = settings.ALERTS_VERIFICATION_FAILURE_THRESHOLD
    return [
        Signal(
            kind=Kind.VERIFICATION_FAILURES,
            key=slug,
            summary=f"{sum(reasons.values())} inbound verification failures for source "
            f"{slug} since the previous check",
            details={"source": slug, "reasons": reasons},
        )
        for slug, reasons in sorted(by_source.items())
        if sum(reasons.values()) >= threshold
    ]
