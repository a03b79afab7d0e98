"""The workers' take with the database broker: unpublished outbox rows by priority, then
age (outbox_claimable, partial: only rows waiting to be taken).

Expand only. On PostgreSQL the index is built CONCURRENTLY (a non-atomic migration): the
outbox keeps its published rows until retention prunes them, and publishing goes on while
the build reads them."""

from django.db import migrations, models
from django.db.models import Q

from deliveries.core.sql import add_index_concurrently

INDEX = models.Index(
    models.F("priority").desc(),
    "created_at",
    condition=Q(published_at__isnull=True),
    name="outbox_claimable",
)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("trusty_jobs", "0005_looprun_smtp_kind")]

    operations = [add_index_concurrently("trusty_jobs", "Outbox", INDEX)]
