"""Reads for polling and backfill."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .models import BackfillRun, BackfillState


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
