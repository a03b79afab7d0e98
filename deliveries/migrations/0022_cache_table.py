"""The database cache's table (settings.CACHES, "webhooks_cache" by default), where the
throttles count: created by ``migrate`` so that every way of setting the service up has
it. With CACHE_URL naming another cache there is nothing to create."""

from django.core.management import call_command
from django.db import migrations


def create_cache_table(apps, schema_editor):
    # createcachetable skips tables that exist, and caches that are not database caches.
    call_command("createcachetable", database=schema_editor.connection.alias, verbosity=0)


class Migration(migrations.Migration):
    dependencies = [("deliveries", "0021_looprun_poll_and_tasks_queue")]

    operations = [migrations.RunPython(create_cache_table, migrations.RunPython.noop)]
