"""Units for django-q2 ``Schedule`` rows: one per poll source, created with the source
(``ingest.poll_sources.poll_schedule_ensure``). ``poll SLUG --once`` runs the same unit."""

from .poll_sources import poll_source_run


def poll_pass(slug: str) -> dict:
    result = poll_source_run(slug=slug)
    return {"outcome": result.outcome, "error": result.error, **result.counts}
