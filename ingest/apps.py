from importlib import import_module

from django.apps import AppConfig

from ingest.conf import settings


class IngestConfig(AppConfig):
    name = "ingest"
    verbose_name = "Inbound webhooks"
    # The key type its migrations were made with, whatever the host's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"
    # Composed by deliveries.urls: this app's API routes and the receiver.
    api_router = "ingest.api.urls.router"
    urls_module = "ingest.urls"

    def ready(self) -> None:
        from django.core.checks import register
        from django.db.models.signals import post_delete, post_save

        from deliveries.core import alerts, retention
        from deliveries.core.conf import on_readable_settings
        from deliveries.core.console import register_panel
        from deliveries.core.prometheus import register_provider
        from deliveries.jobs import kinds

        from . import jobs  # noqa: F401  (registers the console's poll and backfill jobs)
        from .alerts import verification_failure_check
        from .metrics import inbound_gauges, polling_gauges
        from .models import Source, SourceSecret
        from .retention import inbound_pruner
        from .selectors import inbound_overview
        from .sources import check_trusted_proxies, forget_sources
        from .state import inbound_schedule
        from .statements import KIND
        from .worker import inbound_process

        register(on_readable_settings(check_trusted_proxies))
        kinds.register(kinds.JobKind(KIND, process=inbound_process, schedule=inbound_schedule))
        register_provider("inbound", inbound_gauges)
        register_provider("polling", polling_gauges)
        register_panel("inbound", inbound_overview)
        alerts.register_check("verification_failures", verification_failure_check)
        retention.register(inbound_pruner)
        for model in (Source, SourceSecret):
            for signal in (post_save, post_delete):
                signal.connect(
                    forget_sources, sender=model, dispatch_uid=f"forget-{model.__name__}"
                )
        # The application's handler modules (they register with @handler on import).
        for module in settings.INGEST_HANDLER_MODULES:
            import_module(module)
