"""Compress event bodies with lz4.

PostgreSQL compresses a body over about 2 KB as it stores it, inside the caller's
publishing transaction. For a 64 KiB JSON order, pglz (PostgreSQL's default) cost the
backend 1.4 ms of CPU per row and lz4 0.3-0.37 ms; reading back 0.10-0.14 against
0.08-0.10 ms; the stored sizes within 8 % (bench/toast_compression.py,
docs/benchmarks.md). Only new values change, without a
rewrite; rows stored before keep pglz and read as before. A server built without lz4
keeps pglz (a notice, not an error). PostgreSQL only."""

from django.db import migrations

from deliveries.core.sql import compress_with_lz4


class Migration(migrations.Migration):
    dependencies = [("deliveries", "0013_delivery_due_endpoint")]

    operations = [compress_with_lz4("deliveries_event", "body")]
