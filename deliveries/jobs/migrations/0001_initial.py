"""The job machinery's models, taken over from the deliveries app with their tables as
they are: Django's state moves (SeparateDatabaseAndState, nothing in the database
changes), and so do their content types, so that the permissions and admin log entries
that point at them follow."""

import uuid

from django.db import migrations, models

MOVED = ["entitylock", "looprun", "outbox", "queuemessage"]


def move_content_types(apps, old: str, new: str) -> None:
    # Where the new label has a content type already (a migrate that stopped before this
    # one made it), the old one is left for remove_stale_contenttypes.
    ContentType = apps.get_model("contenttypes", "ContentType")
    taken = ContentType.objects.filter(app_label=new, model__in=MOVED).values("model")
    ContentType.objects.filter(app_label=old, model__in=MOVED).exclude(model__in=taken).update(
        app_label=new
    )


def content_types_follow(apps, schema_editor):
    move_content_types(apps, "deliveries", "trusty_jobs")


def content_types_go_back(apps, schema_editor):
    move_content_types(apps, "trusty_jobs", "deliveries")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("deliveries", "0024_tenant_external_id"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name='EntityLock',
                    fields=[
                        ('key', models.CharField(max_length=300, primary_key=True, serialize=False)),
                        ('owner', models.CharField(max_length=100)),
                        ('expires_at', models.DateTimeField()),
                    ],
                    options={
                        'db_table': 'deliveries_entitylock',
                    },
                ),
                migrations.CreateModel(
                    name='LoopRun',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('kind', models.CharField(choices=[('scheduler', 'Scheduler'), ('relay', 'Relay'), ('workers', 'Workers'), ('poll', 'Poll')], max_length=16)),
                        ('host', models.CharField(max_length=200)),
                        ('pid', models.PositiveIntegerField()),
                        ('started_at', models.DateTimeField()),
                        ('heartbeat_at', models.DateTimeField()),
                        ('finished_at', models.DateTimeField(blank=True, null=True)),
                        ('ticks', models.PositiveBigIntegerField(default=0)),
                        ('counts', models.JSONField(default=dict)),
                    ],
                    options={
                        'db_table': 'deliveries_looprun',
                        'indexes': [models.Index(fields=['kind', '-started_at'], name='looprun_kind_started')],
                    },
                ),
                migrations.CreateModel(
                    name='Outbox',
                    fields=[
                        ('id', models.BigAutoField(primary_key=True, serialize=False)),
                        ('message_key', models.CharField(max_length=80, unique=True)),
                        ('kind', models.CharField(default='delivery', max_length=20)),
                        ('ref_id', models.UUIDField()),
                        ('dispatch', models.PositiveIntegerField()),
                        ('priority', models.SmallIntegerField(default=0)),
                        ('created_at', models.DateTimeField()),
                        ('claimed_until', models.DateTimeField(blank=True, null=True)),
                        ('published_at', models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        'verbose_name_plural': 'outbox',
                        'db_table': 'deliveries_outbox',
                        'indexes': [models.Index(condition=models.Q(('published_at__isnull', True)), fields=['id'], name='outbox_unpublished')],
                    },
                ),
                migrations.CreateModel(
                    name='QueueMessage',
                    fields=[
                        ('id', models.BigAutoField(primary_key=True, serialize=False)),
                        ('queue', models.CharField(max_length=100)),
                        ('payload', models.TextField()),
                        ('priority', models.SmallIntegerField(default=0)),
                        ('visible_at', models.DateTimeField()),
                        ('receives', models.PositiveIntegerField(default=0)),
                        ('created_at', models.DateTimeField()),
                    ],
                    options={
                        'db_table': 'deliveries_queuemessage',
                        'indexes': [models.Index(fields=['queue', '-priority', 'visible_at'], name='queue_visible')],
                    },
                ),
            ],
        ),
        migrations.RunPython(content_types_follow, content_types_go_back),
    ]
