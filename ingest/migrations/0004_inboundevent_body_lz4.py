"""Compress inbound event bodies with lz4, as deliveries 0014 does event bodies (its
docstring has the measurements): here the compression happens in the receive view's
transaction, before the provider gets its 2xx."""

from django.db import migrations

from deliveries.core.sql import compress_with_lz4


class Migration(migrations.Migration):
    dependencies = [("ingest", "0003_inbound_source_no_separate_index")]

    operations = [compress_with_lz4("ingest_inboundevent", "body")]
