"""The poll unit moved from ``ingest.tasks`` to ``ingest.schedules``: every poll
source's ``Schedule`` row names the new module; reversed, the old one again."""

from django.db import migrations

from deliveries.schedules import schedule_funcs_move


def forwards(apps, schema_editor):
    schedule_funcs_move(apps, old="ingest.tasks", new="ingest.schedules")


def backwards(apps, schema_editor):
    schedule_funcs_move(apps, old="ingest.schedules", new="ingest.tasks")


class Migration(migrations.Migration):
    dependencies = [
        ("ingest", "0008_inboundevent_body_sha256"),
        ("django_q", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, backwards, elidable=True)]
