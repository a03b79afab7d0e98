"""The job machinery's models leave the deliveries app's state for deliveries.jobs
(trusty_jobs 0001); their tables stay as they are."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0024_tenant_external_id"),
        ("trusty_jobs", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.DeleteModel(
                    name='EntityLock',
                ),
                migrations.DeleteModel(
                    name='LoopRun',
                ),
                migrations.DeleteModel(
                    name='Outbox',
                ),
                migrations.DeleteModel(
                    name='QueueMessage',
                ),
            ],
        ),
    ]
