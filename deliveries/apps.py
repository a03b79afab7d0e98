from django.apps import AppConfig


class DeliveriesConfig(AppConfig):
    name = "deliveries"
    verbose_name = "Outbound webhooks"

    def ready(self) -> None:
        from . import (
            checks,  # noqa: F401  (registers the system checks)
            tracing,
        )

        tracing.configure()
