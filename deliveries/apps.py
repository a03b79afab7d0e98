from django.apps import AppConfig


class DeliveriesConfig(AppConfig):
    name = "deliveries"
    verbose_name = "Outbound webhooks"

    def ready(self) -> None:
        from deliveries.prometheus import register_provider

        from . import (
            checks,  # noqa: F401  (registers the system checks)
            tracing,
        )
        from .metrics import delivery_gauges

        tracing.configure()
        register_provider("deliveries", delivery_gauges)
