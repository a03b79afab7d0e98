"""Retention: history pruned after configurable windows, in bounded batches, safe while
the scheduler, relay and workers run.

Each *pruner* deletes one kind of history in batches of at most ``batch_size`` rows, one
short transaction per batch. A batch locks its candidates with ``FOR UPDATE SKIP
LOCKED`` and deletes them only if they still match (terminal, old enough), so a row a
worker or an operator is changing at that moment is skipped, and a row it would change
next is gone or untouched, never half-deleted. Rows that are not terminal are never
candidates. The apps register their pruners (``ingest`` registers inbound events).

Identities kept for their duplicate windows (docs/operations.md, "Retention"):

- an Event carrying an ``Idempotency-Key`` is what makes a retried create request
  answer with the first event instead of publishing again: it is kept for at least
  IDEMPOTENCY_KEY_RETENTION, whatever RETENTION_DELIVERIES_DAYS says;
- an InboundEvent is the (source, event_id) identity that turns a provider's late retry
  into a counted duplicate: it is kept for at least INBOUND_DEDUPE_WINDOW.
"""

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from .conf import settings
from .prometheus import PRUNED_ROWS

logger = logging.getLogger("deliveries.retention")


@dataclass(frozen=True)
class Pruner:
    """``candidates(now)``: querysets (one per index-friendly slice) of rows to delete,
    in deletion order; each is re-applied as the guard of the DELETE."""

    name: str
    candidates: Callable[[datetime], list[QuerySet]]


PRUNERS: dict[str, Pruner] = {}


def register(pruner: Pruner) -> None:
    PRUNERS[pruner.name] = pruner


def days(n: float) -> timedelta:
    return timedelta(days=n)


# --- Running ----------------------------------------------------------------------------


def _batch(qs: QuerySet, limit: int) -> Counter:
    """Delete up to ``limit`` rows of ``qs`` in one transaction; returns rows deleted by
    table (related rows, such as a delivery's attempts, included)."""
    with transaction.atomic():
        ids = list(qs.select_for_update(skip_locked=True).values_list("pk", flat=True)[:limit])
        if not ids:
            return Counter()
        # The candidate filter again as the guard: only rows still matching go.
        _, per_model = qs.model.objects.filter(pk__in=ids).filter(pk__in=qs.values("pk")).delete()
    return Counter({label.split(".")[-1].lower(): n for label, n in per_model.items() if n})


def prune(
    *,
    now: datetime | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    dry_run: bool = False,
    only: list[str] | None = None,
    pause: float = 0.0,
) -> Counter:
    """Run every pruner (or ``only`` these) until nothing is left to prune or
    ``max_batches`` batches per slice ran. Returns rows deleted by pruner name (and
    related rows deleted with them as ``name.table``, e.g. ``deliveries.attempt``).
    ``dry_run``: count the candidates (up to ``batch_size * max_batches`` per slice, 100
    batches without a maximum) and delete nothing. ``pause``: seconds between
    batches, to leave the database some air on a large first prune."""
    now = now or timezone.now()
    batch_size = batch_size or settings.PRUNE_BATCH_SIZE
    totals: Counter = Counter()
    for name, pruner in PRUNERS.items():
        if only and name not in only:
            continue
        totals[name] += 0  # named in the summary even when nothing went
        for qs in pruner.candidates(now):
            if dry_run:
                cap = batch_size * (max_batches or 100)
                totals[name] += len(qs.values_list("pk", flat=True)[:cap])
                continue
            batches = 0
            while max_batches is None or batches < max_batches:
                deleted = _batch(qs, batch_size)
                batches += 1
                main_table = qs.model._meta.model_name
                for table, n in deleted.items():
                    PRUNED_ROWS.labels(table).inc(n)
                    totals[name if table == main_table else f"{name}.{table}"] += n
                if deleted.get(main_table, 0) < batch_size:
                    break
                if pause:
                    time.sleep(pause)
    logger.info(
        "prune finished",
        extra={"action": "retention.prune", "dry_run": dry_run, "outcome": dict(totals)},
    )
    return totals
