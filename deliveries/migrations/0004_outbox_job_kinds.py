from django.db import migrations, models


def copy_delivery_ids(apps, schema_editor):
    Outbox = apps.get_model("deliveries", "Outbox")
    Outbox.objects.update(ref_id=models.F("delivery_id"))


class Migration(migrations.Migration):
    """The outbox carries any job kind: ``delivery`` becomes (``kind``, ``ref_id``)."""

    dependencies = [("deliveries", "0003_admin_console")]

    operations = [
        migrations.AddField(
            model_name="outbox",
            name="kind",
            field=models.CharField(default="delivery", max_length=20),
        ),
        migrations.AddField(model_name="outbox", name="ref_id", field=models.UUIDField(null=True)),
        migrations.RunPython(copy_delivery_ids, migrations.RunPython.noop),
        migrations.AlterField(model_name="outbox", name="ref_id", field=models.UUIDField()),
        migrations.RemoveField(model_name="outbox", name="delivery"),
        migrations.AlterField(
            model_name="outbox",
            name="message_key",
            field=models.CharField(max_length=80, unique=True),
        ),
    ]
