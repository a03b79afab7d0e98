from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class IngestConfig(AppConfig):
    name = "ingest"
    verbose_name = "Inbound webhooks"

    def ready(self) -> None:
        from deliveries import jobs

        from .services import KIND, inbound_process, inbound_schedule

        jobs.register(jobs.JobKind(KIND, process=inbound_process, schedule=inbound_schedule))
        # The application's handler modules (they register with @handler on import).
        for module in settings.INGEST_HANDLER_MODULES:
            import_module(module)
