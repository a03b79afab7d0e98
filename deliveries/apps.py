from django.apps import AppConfig


class DeliveriesConfig(AppConfig):
    name = "deliveries"
    verbose_name = "Outbound webhooks"
    # The key type its migrations were made with, whatever the host's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"
    # Composed by deliveries.urls: the customer API's routes of this app.
    api_router = "deliveries.api.urls.router"

    def ready(self) -> None:
        from deliveries.prometheus import register_provider

        from . import (
            checks,  # noqa: F401  (registers the system checks)
            tracing,
        )
        from .jobs import kinds
        from .metrics import delivery_gauges
        from .queries import DELIVERY_KIND
        from .selectors import delivery_trace_contexts

        tracing.configure()
        register_provider("deliveries", delivery_gauges)
        # Deliveries are a job kind whose admission and sending the scheduler and the
        # workers' lanes own; the relay reads their trace contexts through the kind.
        kinds.register(kinds.JobKind(DELIVERY_KIND, trace_contexts=delivery_trace_contexts))
