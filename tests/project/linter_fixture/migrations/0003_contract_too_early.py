from django.db import migrations, models


class Migration(migrations.Migration):
    """Backward-incompatible: the previous release still reads `legacy` and inserts rows
    without `weight` (a NOT NULL column whose default lives only in Python)."""

    dependencies = [("linter_fixture", "0002_expand")]

    operations = [
        migrations.RemoveField("widget", "legacy"),
        migrations.AddField("widget", "weight", models.IntegerField(default=0)),
    ]
