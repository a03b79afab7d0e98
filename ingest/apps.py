from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class IngestConfig(AppConfig):
    name = "ingest"
    verbose_name = "Inbound webhooks"

    def ready(self) -> None:
        from deliveries import alerts, jobs, retention
        from project.metrics import register_provider

        from .alerts import verification_failure_check
        from .metrics import inbound_gauges
        from .retention import inbound_pruner
        from .services import KIND, inbound_process, inbound_schedule

        jobs.register(jobs.JobKind(KIND, process=inbound_process, schedule=inbound_schedule))
        register_provider("inbound", inbound_gauges)
        alerts.register_check("verification_failures", verification_failure_check)
        retention.register(inbound_pruner)
        # The application's handler modules (they register with @handler on import).
        for module in settings.INGEST_HANDLER_MODULES:
            import_module(module)
