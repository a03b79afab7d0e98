"""LoopRun's kind gains "poll", the runs of the poll loop (choices only: no SQL)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0016_delivery_listing"),
    ]

    operations = [
        migrations.AlterField(
            model_name="looprun",
            name="kind",
            field=models.CharField(
                choices=[
                    ("scheduler", "Scheduler"),
                    ("relay", "Relay"),
                    ("workers", "Workers"),
                    ("poll", "Poll"),
                ],
                max_length=16,
            ),
        ),
    ]
