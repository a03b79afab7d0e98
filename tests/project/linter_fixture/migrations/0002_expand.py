from django.db import migrations, models


class Migration(migrations.Migration):
    """Expand: what the previous release keeps working with."""

    dependencies = [("linter_fixture", "0001_initial")]

    operations = [
        migrations.AddField("widget", "colour", models.CharField(max_length=20, null=True)),
        migrations.AddField(
            "widget", "size", models.IntegerField(default=1, db_default=1)
        ),
    ]
