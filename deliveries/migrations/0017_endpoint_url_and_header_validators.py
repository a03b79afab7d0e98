"""The endpoint URL and custom-header rules as field validators (the admin's form and
``full_clean`` apply them). State only: no SQL."""

import deliveries.egress
import deliveries.headers
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0016_delivery_listing"),
    ]

    operations = [
        migrations.AlterField(
            model_name="endpoint",
            name="headers",
            field=models.JSONField(
                blank=True, default=dict, validators=[deliveries.headers.validate_endpoint_headers]
            ),
        ),
        migrations.AlterField(
            model_name="endpoint",
            name="url",
            field=models.URLField(
                max_length=2000, validators=[deliveries.egress.validate_endpoint_url]
            ),
        ),
    ]
