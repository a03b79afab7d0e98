"""The django-q2 units moved from ``deliveries.tasks`` to ``deliveries.schedules``: the
``Schedule`` rows that call them (``install_schedules``' and any made in the admin, such
as ``scheduler_pass``) name the new module; reversed, the old one again."""

from django.db import migrations

from deliveries.schedules import schedule_funcs_move


def forwards(apps, schema_editor):
    schedule_funcs_move(apps, old="deliveries.tasks", new="deliveries.schedules")


def backwards(apps, schema_editor):
    schedule_funcs_move(apps, old="deliveries.schedules", new="deliveries.tasks")


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0025_job_models_move_to_trusty_jobs"),
        ("django_q", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, backwards, elidable=True)]
