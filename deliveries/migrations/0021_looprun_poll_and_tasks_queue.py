"""Two separate queues on the broker, and the poll loop's runs.

django-q2's cluster now has a queue of its own (TASKS_QUEUE_NAME) beside the pipeline's
(QUEUE_NAME, whose name and messages are unchanged: every message in flight is still
delivered). django-q2 tasks that a qcluster left in the pipeline's queue of the database
broker move to its own queue, where a qcluster reads them; the pipeline's messages are
JSON objects, which a django-q2 signed package never is, and stay. A release that
predates this one reads only the pipeline's queue, as before.

LoopRun's kind gains "poll" (choices only: no SQL)."""

from django.db import migrations, models
from django_q.conf import Conf

from deliveries.core.conf import settings


def move_tasks(apps, schema_editor):
    QueueMessage = apps.get_model("deliveries", "QueueMessage")
    tasks_queue = Conf.CLUSTER_NAME  # Q_CLUSTER["name"]; django-q2's "default" without one
    if tasks_queue == settings.QUEUE_NAME:
        return  # misconfigured (deliveries.E007): nothing can be told apart
    QueueMessage.objects.filter(queue=settings.QUEUE_NAME).exclude(payload__startswith="{").update(
        queue=tasks_queue
    )


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0020_egressallowance"),
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
        migrations.RunPython(move_tasks, migrations.RunPython.noop, elidable=True),
    ]
